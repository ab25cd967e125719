"""``kvcanary explain LOG...``: SGLang's ``--kv-canary log`` violation blocks (and kvcanary's
own JSON Lines) read back as distinct findings with their causes and patterns."""

from __future__ import annotations

import json
import sys

import click

from .audit import write_report
from .common import ERROR_PREFIX, EXIT_CLEAN, EXIT_ERROR, EXIT_VIOLATIONS, error_boundary

DEFAULT_MAX_FINDINGS = 50


def _open(path: str):
    if path == "-":
        return sys.stdin
    return open(path, encoding="utf-8", errors="replace", newline=None)


def _lines(stream, limit: int):
    """Lines of at most ``limit`` characters (a longer line comes back as one over-long
    marker line, so memory stays bounded whatever the input)."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith("\n"):
            while True:   # drop the rest of the over-long line
                rest = stream.readline(limit)
                if not rest or rest.endswith("\n"):
                    break
            yield "x" * (limit + 1)
            continue
        yield line


def _steps(f) -> str:
    if f.first_step is None:
        return ""
    return (f", step {f.first_step}" if f.first_step == f.last_step
            else f", steps {f.first_step}..{f.last_step}")


def render_text(x, patterns, shown: list, echo) -> None:
    echo(f"explain: {len(x.sources)} input(s), {x.rows} violation row(s) "
         f"({x.json_records} from kvcanary JSON), {len(x.findings)} distinct finding(s)"
         + (f", {x.unparsed} unparsable violation line(s) skipped" if x.unparsed else ""))
    lines = []
    for number, f in enumerate(shown, 1):
        v = f.violation
        lines.append(f"finding {number}: {v.log_line()}")
        lines.append(f"  seen {f.count} time(s) by {', '.join(f.launch_tags)}{_steps(f)}, in "
                     f"{', '.join(f.sources)}")
        where = f.where()
        if where:
            lines.append(f"  at: {where}")
        lines.append(f"  failed checks: {', '.join(f.checks())}")
        lines.append(f"  likely cause: {f.diagnosis.text}")
        if f.patterns:
            lines.append(f"  patterns: {', '.join(f.patterns)}")
    if lines:
        echo("\n".join(lines))
    omitted = len(x.findings) - len(shown)
    if omitted > 0:
        echo(f"findings: the first {len(shown)} of {len(x.findings)} are shown; {omitted} more "
             "are counted below (--max-findings 0 shows all)")
    if x.tags:
        echo("rows by tag: " + ", ".join(f"{t} {c}" for t, c in sorted(x.tags.items()))
             + "; by part: " + ", ".join(f"{p} {c}" for p, c in x.families().items()))
    for p in patterns:
        echo(f"pattern {p.kind}: {p.text}")
    counts = ", ".join(f"{label} {count}" for label, count in sorted(x.reasons.items()))
    verdict = "VIOLATIONS" if x.rows else "CLEAN"
    text = f"summary: {verdict}: {x.rows} row(s), {len(x.findings)} distinct finding(s)"
    if counts:
        text += f"; failed checks, counted per check over rows (a row can fail several): [{counts}]"
    if x.rows_not_kept:
        text += (f"; {x.rows_not_kept} row(s) of corruptions past the first "
                 f"{len(x.findings)} distinct ones counted but not kept")
    if x.ring_overflow:
        text += (f"; ring overflow: {x.total_reported} violations reported, counts are lower "
                 "bounds")
    echo(text)


def summary_record(x, patterns, shown: list) -> dict:
    from collections import Counter

    causes = Counter(f.diagnosis.cause for f in x.findings)
    return {"record": "summary", "inputs": list(x.sources), "violations": x.rows,
            "json_records": x.json_records, "distinct_findings": len(x.findings),
            "reported": len(shown), "findings_cut": len(shown) < len(x.findings),
            "findings_omitted": len(x.findings) - len(shown), "unparsed_lines": x.unparsed,
            "ring_overflow": x.ring_overflow, "total_violations_reported": x.total_reported,
            "counts_by_reason": dict(sorted(x.reasons.items())),
            "counts_by_tag": dict(sorted(x.tags.items())), "counts_by_part": x.families(),
            "counts_by_cause": dict(sorted(causes.items())),
            "rows_by_input": dict(x.rows_by_source), "rows_not_kept": x.rows_not_kept,
            "patterns": [p.kind for p in patterns]}


def report_section(x, patterns, shown: list) -> dict:
    """The HTML report's section (kvcanary.report's model) for what was read: the summary
    and finding records of the JSON output, the patterns as notes; logs have no tables, so
    the section has no maps."""
    summary = summary_record(x, patterns, shown)
    del summary["record"]
    return {"name": ", ".join(x.sources) or "no input", "summary": summary,
            "findings": [f.to_dict() for f in shown],
            "notes": [f"pattern {p.kind}: {p.text}" for p in patterns]}


def render_json(x, patterns, shown: list, echo) -> None:
    echo(json.dumps({"record": "config", "command": "explain", "inputs": list(x.sources)}))
    if shown:
        echo("\n".join(json.dumps({"record": "violation", **f.to_dict()}) for f in shown))
    if patterns:
        echo("\n".join(json.dumps(p.to_dict()) for p in patterns))
    echo(json.dumps(summary_record(x, patterns, shown)))


@click.command("explain")
@click.argument("logs", nargs=-1, required=True, metavar="LOG...")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True,
              help="text, or JSON Lines (config, violation..., pattern..., summary).")
@click.option("--max-findings", type=click.IntRange(min=0), default=DEFAULT_MAX_FINDINGS,
              show_default=True, help="Distinct findings printed (0: all); counts cover all.")
@click.option("--html", "html", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write a self-contained HTML report (summary, findings table, "
                   "patterns) here; needs the report extra.")
def explain_command(logs, fmt, max_findings, html):
    """Read SGLang's `--kv-canary log` violation blocks (server logs, any other text mixed
    in) and kvcanary's JSON Lines from each LOG (a file, or - for stdin); merge the rows
    that report one corruption and explain it.

    Exit 0: no violation rows; 1: violations; 2: an input could not be read."""
    from kvcanary.audit.explain import MAX_LINE, Explanation

    if html:   # before any work: a missing extra is one error line, exit 2
        from kvcanary.report.render import require_renderer

        with error_boundary():
            require_renderer()
    x = Explanation()
    code = EXIT_CLEAN
    for path in logs:
        try:
            stream = _open(path)
            try:
                x.read(_lines(stream, MAX_LINE), "<stdin>" if path == "-" else path)
            finally:
                if stream is not sys.stdin:
                    stream.close()
        except (OSError, UnicodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            click.echo(f"{ERROR_PREFIX}{path}: {reason}", err=True)
            code = EXIT_ERROR
    patterns = x.finish()
    shown = x.findings if max_findings == 0 else x.findings[:max_findings]
    (render_json if fmt == "json" else render_text)(x, patterns, shown, click.echo)
    if html:
        write_report(html, [report_section(x, patterns, shown)], command="explain",
                     announce=fmt == "text")
    if code == EXIT_CLEAN and x.rows:
        code = EXIT_VIOLATIONS
    sys.exit(code)
