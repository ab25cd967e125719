"""The report model as one self-contained HTML page (jinja2 templates shipped as package
data; the styles and script are inlined, the maps drawn by the page from inline data)."""

from __future__ import annotations

import re

from ..system.atomic import replacing
from .palette import page_palette

# Findings-table columns, in order, for the keys a finding has (label, key); -1 in the index
# columns means "not applicable" (a sweep entry has no request row).
COLUMNS = (("tag", "launch_tag"), ("reasons", "fail_reason"), ("entry", "entry"),
           ("request row", "request_row"), ("batch", "batch_index"),
           ("position", "expected_position"), ("stored position", "position"),
           ("slot", "slot_idx"), ("block", "block"), ("sweep entry", "sweep_index"),
           ("failed checks", "failed_checks"))
NOT_APPLICABLE = {"request_row", "batch_index", "expected_position", "sweep_index", "block"}
# The first of these a finding has is its explanation.
EXPLANATION_KEYS = ("explanation", "likely_cause", "cause")
HIDDEN_KEYS = {"record", "dump"}
# Headings of the summary's listed records, where the key alone would say too little.
HEADINGS = {"requests": "affected requests"}
# Affected requests listed in the page (the summary counts all of them).
REQUESTS_LISTED = 500
INSTALL_HINT = "pip install 'kvcanary[report]'"


class ReportUnavailable(ImportError):
    """The HTML report's extra (jinja2) is not installed."""


def _environment():
    try:
        import jinja2
    except ImportError:
        raise ReportUnavailable(f"the HTML report needs jinja2: {INSTALL_HINT}") from None
    env = jinja2.Environment(loader=jinja2.PackageLoader("kvcanary.report", "templates"),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.ChainableUndefined)
    env.filters["cell"] = _cell
    return env


def require_renderer() -> None:
    """Raise :class:`ReportUnavailable` now, before any work, when the page cannot be made."""
    _environment()


def _cell(value, nested: bool = False) -> str:
    """A value in words: lists and dicts (a diagnosis's ``related`` entries) as words too,
    never as a Python repr; a dict inside a list in parentheses."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        text = ", ".join(_cell(v, True) for v in value)
    elif isinstance(value, dict):
        text = ", ".join(f"{str(k).replace('_', ' ')} {_cell(v)}" for k, v in value.items())
    else:
        return "" if value is None else str(value)
    return f"({text})" if nested and text else text


def _table(findings: list) -> dict:
    """The findings table: the known columns some finding has a value for, the explanation,
    and every other field as details (shown under the explanation)."""
    present = set().union(*(f.keys() for f in findings)) if findings else set()
    explanation = next((key for key in EXPLANATION_KEYS if key in present), None)
    columns = [(label, key) for label, key in COLUMNS
               if any(_applicable(f, key) for f in findings)]
    shown = {key for _, key in COLUMNS} | {explanation} | HIDDEN_KEYS
    rows = []
    for index, finding in enumerate(findings):
        cells = []
        for _, key in columns:
            value = finding.get(key) if _applicable(finding, key) else None
            cells.append(" + ".join(_reasons(value)) if key == "fail_reason" else _cell(value))
        rows.append({"index": index, "cells": cells,
                     "reasons": " ".join(_reasons(finding.get("fail_reason", ""))),
                     "tag": finding.get("launch_tag", ""),
                     "explanation": _cell(finding.get(explanation)) if explanation else "",
                     "details": "; ".join(f"{k}={_cell(v)}" for k, v in finding.items()
                                          if k not in shown)})
    reasons = sorted({r for row in rows for r in row["reasons"].split()})
    tags = sorted({row["tag"] for row in rows if row["tag"]})
    numeric = [any(_number(f.get(key)) for f in findings) and
               all(_number(f.get(key)) or not _applicable(f, key) for f in findings)
               for _, key in columns]
    return {"columns": [(label, number) for (label, _), number in zip(columns, numeric)],
            "explained": explanation is not None,
            "rows": rows, "reasons": reasons, "tags": tags}


def _applicable(finding: dict, key: str) -> bool:
    value = finding.get(key)
    return value is not None and not (key in NOT_APPLICABLE and value == -1)


def _number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reasons(text) -> list:
    """Reason labels of a ``fail_reason`` text (``a+b``)."""
    return [r for r in re.split(r"[+|,\s]+", str(text or "")) if r]


def _summary(summary: dict) -> dict:
    """Counts (dict-valued keys), listed records (list-valued) and the rest, as the page
    shows them."""
    counts = {k: v for k, v in summary.items() if isinstance(v, dict) and v}
    lists = {k: v for k, v in summary.items()
             if isinstance(v, list) and v and all(isinstance(i, dict) for i in v)}
    scalars = {k: v for k, v in summary.items()
               if k not in counts and k not in lists and not isinstance(v, (dict, list))
               and k not in HIDDEN_KEYS}
    return {"counts": counts, "lists": lists, "scalars": scalars}


def render_html(report: dict) -> str:
    """The page of a report model (:func:`kvcanary.report.build_report`) as a string."""
    env = _environment()
    sections = []
    for section in report.get("sections", []):
        findings = section.get("findings") or []
        sections.append({**section, "table": _table(findings),
                         "parts": _summary(section.get("summary") or {})})
    return env.get_template("report.html.j2").render(
        report=report, sections=sections, requests_listed=REQUESTS_LISTED, headings=HEADINGS,
        palette=page_palette())


def write_html(report: dict, path: str) -> str:
    """Write the page of ``report`` to ``path`` (whole or nothing: under a temporary name,
    then renamed); returns ``path``.

    Example::

        write_html(build_report([audit_section(result, maps)]), "report.html")"""
    page = render_html(report)
    try:
        with replacing(path) as temporary:
            with open(temporary, "w", encoding="utf-8") as out:
                out.write(page)
    except OSError as exc:
        # Named by the report's path: not standard output (a write error without a file
        # name), nor the hidden temporary beside it.
        raise OSError(exc.errno, exc.strerror or str(exc), path) from None
    return path
