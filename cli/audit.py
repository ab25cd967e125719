"""``kvcanary audit DUMP...``: verify dumped canary buffers (DESIGN.md, CLI contract)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys

import click

from .common import EXIT_CLEAN, EXIT_ERROR, EXIT_VIOLATIONS, Progress, error_message
from .interrupt import interrupted_record, on_interrupt


def run_audit(path: str, options: dict, progress=None):
    """``("ok", AuditResult)`` or ``("error", message)``; runs in a worker process too."""
    from kvcanary.audit import AuditError, audit
    from kvcanary.dump import DumpError

    try:
        return "ok", audit(path, progress=progress, **options)
    except (DumpError, AuditError, ValueError, OSError, TypeError, MemoryError) as exc:
        message = error_message(exc)
        if not message.startswith(path):
            message = f"{path}: {message}"
        return "error", message
    except ImportError as exc:
        return "error", f"{path}: a needed package is missing: {error_message(exc)}"
    except RuntimeError as exc:  # CUDA runtime or compile errors: the environment
        return "error", f"{path}: the {options.get('backend')} backend failed: {error_message(exc)}"


def render_text(result, echo) -> None:
    r = result
    sources = (f"{r.real_kv_sources} real-KV source(s), {r.real_kv_hash_mode} mode"
               if r.real_kv_sources else "no real-KV sources")
    window = f", SWA window {r.swa_window_size}" if r.swa_window_size else ""
    checks = ("token check on" if r.check_expected_token else "token check off (no expected_tokens)")
    echo(f"audit {r.path}: {r.live_requests} live request(s), {r.num_slots} slots, tag "
         f"{r.launch_tag}, {sources}{window}, {checks}, backend {r.backend}"
         + ("" if not r.compat else ", --compat (kvcanary extensions off)"))
    for finding in r.findings:
        echo(finding.violation.log_line())
        echo(f"  at: {finding.where()}")
        echo(f"  failed checks: {', '.join(finding.checks) or 'none'}")
        echo(f"  likely cause: {finding.cause}")
    echo(summary_line(r))


def summary_line(r) -> str:
    counts = ", ".join(f"{name} {count}" for name, count in r.counts_by_reason.items())
    overflow = (f"ring overflow: {r.dropped} of {r.total_violations} rows dropped "
                f"(ring capacity {r.ring_capacity})" if r.ring_overflow else "no ring overflow")
    verdict = "CLEAN" if r.clean else "VIOLATIONS"
    text = (f"summary {r.path}: {verdict}: checked {r.entries_checked} entries "
            f"({r.live_entries} live prefix, {r.sweep_entries} sweep), "
            f"{r.total_violations} violation(s)")
    if counts:
        text += f" [{counts}]"
    if r.counts_by_tag:
        text += " by tag [" + ", ".join(f"{name} {count}"
                                       for name, count in r.counts_by_tag.items()) + "]"
    if r.unattributed:
        text += f", {r.unattributed} not attributed to a plan entry"
    return f"{text}; {overflow}; {r.elapsed_s:.2f}s"


def render_json(result, echo) -> None:
    echo(json.dumps(result.config_record()))
    for finding in result.findings:
        echo(json.dumps({"record": "violation", "dump": result.path, **finding.to_dict()}))
    echo(json.dumps(result.summary_record()))


@click.command("audit")
@click.argument("dumps", nargs=-1, required=True, metavar="DUMP...")
@click.option("--backend", type=click.Choice(["auto", "numpy", "cupy"]), default="auto",
              show_default=True, help="auto: the CUDA kernels when a GPU is usable, else numpy.")
@click.option("--max-real-kv-sources", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Bound on real-KV sources per launch (kernel variant).")
@click.option("--ring-capacity", type=click.IntRange(min=1), default=None,
              help="Violation rows kept for the report (default: one per checked entry, so "
                   "nothing is dropped). Overflow is reported, never silent.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="text, or JSON Lines (config, violation..., summary).")
@click.option("--compat", is_flag=True,
              help="Upstream's rules only: turn off kvcanary's SLOT_ZERO_IN_PREFIX extension.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Parallel processes for several dumps (default: CPU count).")
def audit_command(dumps, backend, max_real_kv_sources, ring_capacity, fmt, compat, jobs):
    """Verify the canary of each DUMP (.npz, .safetensors or a directory of .npy).

    Exit 0: every dump clean; 1: violations; 2: bad input, usage or environment."""
    options = dict(backend=backend, max_real_kv_sources=max_real_kv_sources,
                   ring_capacity=ring_capacity, compat=compat)
    reported = 0
    if fmt == "json":
        on_interrupt(lambda exc: click.echo(json.dumps(interrupted_record(
            exc, dumps_reported=reported, dumps=len(dumps)))))
    code = EXIT_CLEAN
    # closing: whatever stops the loop (an interrupt) stops the workers with it
    with contextlib.closing(_audit_all(list(dumps), options, jobs)) as outcomes:
        for path, (status, value) in zip(dumps, outcomes):
            if status == "error":
                click.echo(f"kvcanary: error: {value}", err=True)
                if fmt == "json":
                    click.echo(json.dumps({"record": "error", "dump": path, "message": value}))
                code = EXIT_ERROR
            else:
                (render_json if fmt == "json" else render_text)(value, click.echo)
                if not value.clean and code == EXIT_CLEAN:
                    code = EXIT_VIOLATIONS
            reported += 1
    sys.exit(code)


def _audit_all(paths: list, options: dict, jobs):
    """The outcome of every dump, in order, as each is ready."""
    if len(paths) == 1:
        progress = Progress(f"auditing {paths[0]}: entries")
        try:
            yield run_audit(paths[0], options, progress)
        finally:
            progress.close()
        return
    from kvcanary.interrupt import WorkerPool

    def failed(path, exc):   # a worker that died (e.g. out of memory)
        return "error", f"{path}: the audit process failed ({error_message(exc)})"

    progress = Progress("audited dumps")
    # spawn: a forked child would inherit a CUDA context it cannot use.
    with WorkerPool(min(len(paths), jobs or os.cpu_count() or 1), start_method="spawn") as pool:
        try:
            for done, outcome in enumerate(pool.map(functools.partial(run_audit, options=options),
                                                    paths, failed=failed), 1):
                progress(done, len(paths))
                yield outcome
        finally:
            progress.close()
