"""The report model: plain JSON-ready data, one section per audited dump (or read log).

A report is a dict::

    {"command": "audit", "version": "0.1.0",
     "sections": [{"name": ..., "metadata": {...}, "summary": {...}, "findings": [...],
                   "maps": {...} or None, "error": None or a message}],
     "total": {...} or None}

``summary`` is a summary record as ``--format json`` prints it (``violations``,
``entries_checked``, ``counts_by_*``, ``findings_cut`` ...), ``findings`` its violation
records, ``metadata`` label -> value, ``notes`` (optional) sentences shown under the verdict
(e.g. the patterns a log reader found). Every part is optional and extra keys are shown as they
are, so any command whose JSON report has this shape renders with :func:`write_html`.
"""

from __future__ import annotations

import itertools

from .. import __version__


def dump_metadata(dump) -> dict:
    """What a reader needs to know about the dump's layout (label -> value). Counts the
    summary gives (its sweep entries, all of them checked) are not repeated here."""
    table = "block_table" if dump.block_table is not None else "req_to_token"
    layout = (f"paged: {dump.block_size} positions per block" if dump.block_table is not None
              else "per-token slots")
    return {"layout": layout, "container": dump.flavour,
            "table": f"{table} {tuple(int(n) for n in dump.slot_table.shape)}",
            "batch size": dump.batch_size,
            "expected tokens": dump.expected_tokens is not None}


# Findings the page's table lists per dump: a flooded dump with --max-findings 0 keeps
# millions; the page says how many it leaves out and --format json lists every one.
TABLE_FINDINGS = 10_000


def audit_section(result, maps=None, metadata=None) -> dict:
    """A section from a :class:`kvcanary.audit.AuditResult` and, when given, the
    :class:`~kvcanary.report.maps.ReportMaps` it was observed with and :func:`dump_metadata`."""
    config = {key: value for key, value in result.config_record().items()
              if key not in ("record", "dump")}
    return {"name": result.path, "metadata": {**(metadata or {}), **config},
            "summary": {key: value for key, value in result.summary_record().items()
                        if key not in ("record", "dump")},
            "findings": [finding.to_dict()
                         for finding in itertools.islice(result.findings, TABLE_FINDINGS)],
            "findings_left_out": max(0, len(result.findings) - TABLE_FINDINGS),
            "maps": maps.to_dict() if maps is not None else None, "error": None}


def error_section(name: str, message: str) -> dict:
    """A section for an input that could not be read: only its message."""
    return {"name": name, "metadata": {}, "summary": {}, "findings": [], "maps": None,
            "error": message}


def build_report(sections: list, *, command: str = "audit", total: dict | None = None) -> dict:
    """The report of one command run (see the module docstring)."""
    return {"command": command, "version": __version__, "sections": list(sections),
            "total": total}
