"""``kvcanary explain LOG...``: SGLang's ``--kv-canary log`` violation blocks (and kvcanary's
own JSON Lines) read back as distinct findings with their causes and patterns."""

from __future__ import annotations

import json
import sys

import click

from .audit import write_report
from .common import (
    ERROR_PREFIX,
    EXIT_CLEAN,
    EXIT_ERROR,
    EXIT_NO_CANARY_OUTPUT,
    EXIT_VIOLATIONS,
    error_boundary,
    printable,
    require_output_folder,
)

DEFAULT_MAX_FINDINGS = 50


def render_text(x, patterns, shown: list, echo) -> None:
    echo(f"explain: {len(x.sources)} input(s), {x.rows} violation row(s) "
         f"({x.json_records} from kvcanary JSON), {len(x.findings)} distinct finding(s)"
         + (f", {x.unparsed} unparsable violation line(s) skipped" if x.unparsed else "")
         + (f", {x.canary_marks} line(s) showing the canary ran" if x.canary_marks else ""))
    lines = []
    for number, f in enumerate(shown, 1):
        lines.append(f"finding {number}: {f.describe()}")
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
    if x.verdict == "no-canary-output":
        echo("summary: NO CANARY OUTPUT: no violation row and nothing showing the canary ran "
             "(SGLang logs `install_canary:` at start-up under --kv-canary log or raise); "
             "this is not a clean result: is it the log of a server started with "
             "--kv-canary log?")
        return
    verdict = "VIOLATIONS" if x.verdict == "violations" else "CLEAN"
    text = f"summary: {verdict}: {x.rows} row(s), {len(x.findings)} distinct finding(s)"
    if x.unparsed:
        text += f"; {x.unparsed} violation line(s) that could not be read"
    if x.unlogged_violations:
        text += (f"; SGLang's stats lines count {x.unlogged_violations} violation(s) in "
                 "input(s) that log none of their rows")
    if x.verify_skipped:
        text += (f"; {x.verify_skipped} step(s) skipped their verify (SGLang: verify plan "
                 "overflow), so they were not checked")
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
    return {"record": "summary", "inputs": list(x.sources), "verdict": x.verdict,
            "canary_output": x.canary_output, "violations": x.rows,
            "json_records": x.json_records, "distinct_findings": len(x.findings),
            "reported": len(shown), "findings_cut": len(shown) < len(x.findings),
            "findings_omitted": len(x.findings) - len(shown), "unparsed_lines": x.unparsed,
            "ring_overflow": x.ring_overflow, "total_violations_reported": x.total_reported,
            "counts_by_reason": dict(sorted(x.reasons.items())),
            "counts_by_tag": dict(sorted(x.tags.items())), "counts_by_part": x.families(),
            "counts_by_cause": dict(sorted(causes.items())),
            "rows_by_input": dict(x.rows_by_source), "rows_not_kept": x.rows_not_kept,
            "patterns": [p.kind for p in patterns],
            "unlogged_violations": x.unlogged_violations, "verify_skipped": x.verify_skipped}


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
        echo("\n".join(json.dumps(p.to_dict(len(shown))) for p in patterns))
    echo(json.dumps(summary_record(x, patterns, shown)))


@click.command("explain")
@click.argument("logs", nargs=-1, required=True, metavar="LOG...")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True,
              help="text, or JSON Lines (config, violation..., pattern..., summary).")
@click.option("--max-findings", type=click.IntRange(min=0), default=DEFAULT_MAX_FINDINGS,
              show_default=True,
              help="Distinct findings (and patterns of each kind) printed (0: all); counts "
                   "cover all.")
@click.option("--html", "html", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write a self-contained HTML report (summary, findings table, "
                   "patterns) here; needs the report extra.")
def explain_command(logs, fmt, max_findings, html):
    """Read SGLang's `--kv-canary log` violation blocks (server logs, any other text mixed
    in) and kvcanary's JSON Lines from each LOG (a file, or - for stdin); merge the rows
    that report one corruption and explain it.

    Exit 0: the canary ran and reported nothing; 1: violations; 2: an input could not be
    read (a dump is read by `audit`); 3: no canary output in the inputs."""
    if html:   # before any work: a missing extra is one error line, exit 2
        from kvcanary.report.render import require_renderer

        from .common import refuse_output_among_inputs
        refuse_output_among_inputs(html, logs)
        with error_boundary():
            require_renderer()
        require_output_folder(html, "--html")
    x = _read_all(logs)
    patterns = x.finish()
    shown = x.findings if max_findings == 0 else x.findings[:max_findings]
    patterns = bounded_patterns(patterns, max_findings)
    (render_json if fmt == "json" else render_text)(x, patterns, shown, click.echo)
    if html:
        write_report(html, [report_section(x, patterns, shown)], command="explain",
                     announce=fmt == "text")
    sys.exit({"violations": EXIT_VIOLATIONS, "clean": EXIT_CLEAN}.get(x.verdict,
                                                                    EXIT_NO_CANARY_OUTPUT))


def _read_all(logs):
    """Every input read into one Explanation; any input that cannot be read is one error
    line each and exit 2, with no summary (a partial reading is no result)."""
    from kvcanary.cli.log_input import log_lines, open_log
    from kvcanary.audit.explain import Explanation
    from kvcanary.audit.explain_parse import MAX_LINE, ExplainError

    stdin = getattr(sys.stdin, "buffer", sys.stdin)
    held = {}
    failed = False
    for path in dict.fromkeys(logs):   # look at every input first: name each bad one
        try:
            stream, head = open_log(path, stdin)
        except ExplainError as exc:
            click.echo(f"{ERROR_PREFIX}{printable(exc.detail)}", err=True)
            failed = True
            continue
        if path == "-":
            held[path] = head
        else:
            stream.close()
    if failed:
        sys.exit(EXIT_ERROR)
    x = Explanation()
    for path in logs:
        shown = "<stdin>" if path == "-" else path
        try:
            if path == "-":
                stream, head = stdin, held.pop(path, b"")
            else:
                stream, head = open_log(path)
            try:
                x.read(log_lines(stream, head, MAX_LINE), shown)
            finally:
                if path != "-":
                    stream.close()
        except ExplainError as exc:
            click.echo(f"{ERROR_PREFIX}{printable(exc.detail)}", err=True)
            sys.exit(EXIT_ERROR)
        except OSError as exc:
            click.echo(f"{ERROR_PREFIX}{printable(shown)}: {exc.strerror or exc}", err=True)
            sys.exit(EXIT_ERROR)
    return x


def bounded_patterns(patterns: list, limit: int) -> list:
    """``patterns`` with at most ``limit`` of each kind (0: all); the rest of a kind are
    folded into one closing pattern that says how many were left out."""
    if limit == 0:
        return patterns
    from kvcanary.audit.explain import Pattern

    out, seen, left = [], {}, {}
    for p in patterns:
        seen[p.kind] = seen.get(p.kind, 0) + 1
        if seen[p.kind] <= limit:
            out.append(p)
        else:
            left[p.kind] = left.get(p.kind, 0) + 1
    for kind, count in left.items():
        out.append(Pattern(kind, f"{count} more {kind} pattern(s) not shown "
                                 "(--max-findings 0 shows all)"))
    return out
