"""``kvcanary audit DUMP...``: verify dumped canary buffers and render the findings."""

from __future__ import annotations

import contextlib
import functools
import json
import sys

import click

from kvcanary import MAX_REAL_KV_SOURCES, MAX_REAL_KV_SOURCES_LIMIT
from kvcanary.audit import DEFAULT_MAX_FINDINGS
from kvcanary.backends.resolve import BACKENDS
from kvcanary.system.signals import signals_held

from .common import (
    ERROR_PREFIX,
    EXIT_CLEAN,
    EXIT_ERROR,
    EXIT_VIOLATIONS,
    JOBS_RANGE,
    Progress,
    error_boundary,
    error_message,
    printable,
    refuse_output_among_inputs,
    require_output_folder,
    user_error,
)
from .interrupt import interrupted_record, on_interrupt

# Affected requests listed by name in the text summary (JSON lists every one).
TEXT_REQUESTS_SHOWN = 8
# Dumps with violations or not audited named in the text total (JSON names every one).
TEXT_DUMPS_SHOWN = 8
# Processes auditing several dumps: one, the fastest measured (benchmarks/README.md, "Audit of
# several dumps"): a worker must start an interpreter and receive its result, and reading
# large dumps is bound by memory bandwidth more than by the CPU, so -j 2 was slower on 2 cores.
DEFAULT_AUDIT_JOBS = 1


def run_audit(path: str, options: dict, progress=None, html: bool = False):
    """``("ok", AuditResult)`` or ``("error", message)``; runs in a worker process too.
    ``html``: ``("ok", (AuditResult, report section))``, the section with the report's maps."""
    from kvcanary.audit import audit

    try:
        if html:
            return "ok", _audit_for_report(path, options, progress)
        return "ok", audit(path, progress=progress, **options)
    except Exception as exc:
        message = user_error(exc)
        if message is None:
            raise
        shown = printable(path)
        return "error", message if message.startswith(shown) else f"{shown}: {message}"


def _audit_for_report(path: str, options: dict, progress):
    from kvcanary.audit import audit
    from kvcanary.dump import load
    from kvcanary.report import ReportMaps, audit_section, dump_metadata

    dump = load(path)
    maps = ReportMaps(dump)
    result = audit(dump, progress=progress, observe=maps.add, **options)
    return result, audit_section(result, maps, dump_metadata(dump))


def render_text(result, echo) -> None:
    r = result
    sources = (f"{r.real_kv_sources} real-KV source(s), {r.real_kv_hash_mode} mode"
               if r.real_kv_sources else "no real-KV sources")
    window = f", SWA window {r.swa_window_size}" if r.swa_window_size else ""
    checks = ("token check on" if r.check_expected_token else "token check off (no expected_tokens)")
    echo(f"audit {r.path}: {r.live_requests} live request(s), {r.num_slots} slots, tag "
         f"{r.launch_tag}, {sources}{window}, {checks}, backend {r.backend}"
         + ("" if not r.compat else ", --compat (kvcanary extensions off)"))
    # A write per batch of findings: a flooded dump prints millions of lines, streamed
    # (--max-findings 0 keeps every finding, built a batch at a time).
    for batch in _batches(r.findings):
        echo("\n".join(finding.describe() for finding in batch))
    if r.findings_cut:
        echo(f"findings: the first {len(r.findings)} of {r.total_violations} are shown; "
             f"{r.findings_omitted} more are counted below (--max-findings 0 shows all)")
    if r.requests:
        echo(requests_line(r))
    echo(summary_line(r))


def _batches(findings, size: int | None = None):
    """The findings in lists of ``size`` (one write each; by default the audit's batch)."""
    from kvcanary.audit import result as audit_result

    size = size or audit_result.FINDINGS_BATCH
    batch = []
    for finding in findings:
        batch.append(finding)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def requests_line(r) -> str:
    shown = [f"row {q.request_row} (batch index {q.batch_index}) {q.violations} at positions "
             f"{q.first_position}..{q.last_position}" for q in r.requests[:TEXT_REQUESTS_SHOWN]]
    more = len(r.requests) - len(shown)
    tail = f"; and {more} more (--format json lists every one)" if more > 0 else ""
    return f"affected requests: {len(r.requests)}: " + "; ".join(shown) + tail


def summary_line(r) -> str:
    counts = ", ".join(f"{name} {count}" for name, count in r.counts_by_reason.items())
    overflow = (f"ring overflow: {r.dropped} of {r.total_violations} rows dropped "
                f"(ring capacity {r.ring_capacity})" if r.ring_overflow else "no ring overflow")
    verdict = "CLEAN" if r.clean else "VIOLATIONS"
    text = (f"summary {r.path}: {verdict}: checked {r.entries_checked} entries "
            f"({r.live_entries} live prefix, {r.sweep_entries} sweep), "
            f"{r.total_violations} violation(s)")
    if counts:
        text += f"; failed checks, counted per check (a row can fail several): [{counts}]"
    if r.counts_by_tag:
        text += "; rows by tag [" + ", ".join(f"{name} {count}"
                                       for name, count in r.counts_by_tag.items()) + "]"
    if r.unattributed:
        text += f", {r.unattributed} not attributed to a plan entry"
    return f"{text}; {overflow}; {r.elapsed_s:.2f}s"


def render_json(result, echo) -> None:
    echo(json.dumps(result.config_record()))
    for batch in _batches(result.findings):
        echo("\n".join(json.dumps({"record": "violation", "dump": result.path,
                                   **finding.to_dict()}) for finding in batch))
    echo(json.dumps(result.summary_record()))


class Totals:
    """What several dumps add up to: one closing line (text) or record (JSON), naming the
    dumps with violations and those not audited."""

    def __init__(self):
        self.dumps = self.clean = 0
        self.entries = self.violations = 0
        self.with_violations, self.errors = [], []   # their paths

    def add(self, path: str, status: str, result) -> None:
        self.dumps += 1
        if status == "error":
            self.errors.append(path)
            return
        self.entries += result.entries_checked
        self.violations += result.total_violations
        if result.clean:
            self.clean += 1
        else:
            self.with_violations.append(path)

    def record(self) -> dict:
        return {"record": "total", "dumps": self.dumps, "clean": self.clean,
                "with_violations": len(self.with_violations), "errors": len(self.errors),
                "entries_checked": self.entries, "violations": self.violations,
                "dumps_with_violations": self.with_violations,
                "dumps_not_audited": self.errors}

    def line(self) -> str:
        return (f"total: {self.dumps} dumps: {self.clean} clean, "
                f"{len(self.with_violations)} with violations{_named(self.with_violations)}, "
                f"{len(self.errors)} not audited{_named(self.errors)}; {self.entries} entries "
                f"checked, {self.violations} violation(s)")


def _named(paths: list) -> str:
    if not paths:
        return ""
    more = len(paths) - TEXT_DUMPS_SHOWN
    return (" (" + ", ".join(paths[:TEXT_DUMPS_SHOWN])
            + (f" and {more} more" if more > 0 else "") + ")")


@click.command("audit")
@click.argument("dumps", nargs=-1, required=True, metavar="DUMP...")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto",
              show_default=True, help="auto: the CUDA kernels when a GPU is usable, else numpy.")
@click.option("--max-real-kv-sources", type=click.IntRange(1, MAX_REAL_KV_SOURCES_LIMIT),
              default=MAX_REAL_KV_SOURCES, show_default=True,
              help="Bound on real-KV sources per launch, on every backend (kernel variant).")
@click.option("--ring-capacity", type=click.IntRange(min=1), default=None,
              help="Violation rows kept for the report (default: one per checked entry, so "
                   "nothing is dropped). Overflow is reported, never silent.")
@click.option("--max-findings", type=click.IntRange(min=0), default=DEFAULT_MAX_FINDINGS,
              show_default=True,
              help="Findings printed per dump (0: all); totals and counts cover every row.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True,
              help="text, or JSON Lines (config, violation..., summary; total for several).")
@click.option("--compat", is_flag=True,
              help="Upstream's rules only: turn off kvcanary's SLOT_ZERO_IN_PREFIX extension.")
@click.option("-j", "--jobs", type=JOBS_RANGE, default=DEFAULT_AUDIT_JOBS,
              show_default=True,
              help="Processes auditing several dumps at once (1: one after another in this "
                   "process, the fastest measured: each dump's audit is numpy work that "
                   "already uses the cores it can).")
@click.option("--html", "html", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write a self-contained HTML report (maps, findings table) here; "
                   "needs the report extra.")
def audit_command(dumps, backend, max_real_kv_sources, ring_capacity, max_findings, fmt,
                  compat, jobs, html):
    """Verify the canary of each DUMP (.npz, .safetensors or a directory of .npy).

    Exit 0: every dump clean; 1: violations; 2: bad input, usage or environment."""
    options = dict(backend=backend, max_real_kv_sources=max_real_kv_sources,
                   ring_capacity=ring_capacity, max_findings=max_findings, compat=compat)
    if html:
        from kvcanary.report.render import require_renderer

        refuse_output_among_inputs(html, dumps)
        with error_boundary():
            require_renderer()
        require_output_folder(html, "--html")
    sections = []
    reported = 0
    if fmt == "json":
        on_interrupt(lambda exc: click.echo(json.dumps(interrupted_record(
            exc, dumps_reported=reported, dumps=len(dumps)))))
    code = EXIT_CLEAN
    totals = Totals()
    # closing: whatever stops the loop (an interrupt) stops the workers with it
    with contextlib.closing(_audit_all(list(dumps), options, jobs, bool(html))) as outcomes:
        for path, (status, value) in zip(dumps, outcomes):
            if html:
                value = _keep_section(sections, path, status, value)
            totals.add(path, status, value)
            # held: an interrupt between a dump's last record and the count would report
            # one dump fewer than the output holds
            with signals_held():
                if status == "error":
                    click.echo(f"{ERROR_PREFIX}{value}", err=True)
                    if fmt == "json":
                        click.echo(json.dumps({"record": "error", "dump": path,
                                               "message": value}))
                    code = EXIT_ERROR
                else:
                    (render_json if fmt == "json" else render_text)(value, click.echo)
                    if not value.clean and code == EXIT_CLEAN:
                        code = EXIT_VIOLATIONS
                reported += 1
    if len(dumps) > 1:
        click.echo(json.dumps(totals.record()) if fmt == "json" else totals.line())
    if html:
        write_report(html, sections, total=totals.record() if len(dumps) > 1 else None,
                     announce=fmt == "text")
    sys.exit(code)


def _keep_section(sections: list, path: str, status: str, value):
    """Keep the dump's report section; the audit result (or message) goes on as before."""
    from kvcanary.report import error_section

    if status == "error":
        sections.append(error_section(path, value))
        return value
    result, section = value
    sections.append(section)
    return result


def write_report(path: str, sections: list, *, command: str = "audit", total=None,
                 announce: bool = True) -> None:
    """Write the HTML report of ``sections`` (kvcanary.report's model); an error is exit 2."""
    from kvcanary.report import build_report, write_html

    with error_boundary():
        write_html(build_report(sections, command=command, total=total), path)
    if announce:
        click.echo(f"html report: {path}")


def _audit_all(paths: list, options: dict, jobs, html: bool = False):
    """The outcome of every dump, in order, as each is ready."""
    if len(paths) == 1:
        progress = Progress(f"auditing {paths[0]}: entries")
        try:
            yield run_audit(paths[0], options, progress, html)
        finally:
            progress.close()
        return
    from kvcanary.system.signals import WorkerPool

    def failed(path, exc):   # a worker that died (e.g. out of memory)
        return "error", f"{path}: the audit process failed ({error_message(exc)})"

    progress = Progress("audited dumps")
    # spawn: a forked child would inherit a CUDA context it cannot use.
    with WorkerPool(min(len(paths), jobs), start_method="spawn") as pool:
        try:
            audit_one = functools.partial(run_audit, options=options, html=html)
            for done, outcome in enumerate(pool.map(audit_one, paths, failed=failed), 1):
                progress(done, len(paths))
                yield outcome
        finally:
            progress.close()
