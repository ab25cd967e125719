"""A self-contained HTML report of findings: ``kvcanary audit DUMP... --html report.html``.

One file with its styles, script and pictures inline: it opens offline, from a file, and
makes no network request. It shows, per dump, the summary (entries checked, findings, counts
by reason, launch tag and entry, exact totals when the findings were cut), a map of the live
requests by position coloured by reason (block boundaries on a paged dump), a map of the slot
pool (or blocks) marking slots with findings and slots mapped twice, the findings table
(sortable and filterable, with the explanations) and the dump's metadata.

The report is a layer after the audit: it reads the audit's result (the data of its JSON
report) and the maps :class:`ReportMaps` aggregates while the audit runs::

    from kvcanary.audit import audit
    from kvcanary.dump import load
    from kvcanary.report import ReportMaps, audit_section, build_report, dump_metadata, write_html

    dump = load("dump.npz")
    maps = ReportMaps(dump)
    result = audit(dump, observe=maps.add)
    write_html(build_report([audit_section(result, maps, dump_metadata(dump))]), "report.html")

Rendering needs the ``report`` extra (jinja2): ``pip install 'kvcanary[report]'``; the maps
and the model need numpy only.
"""

from __future__ import annotations

from .maps import ReportMaps
from .model import audit_section, build_report, dump_metadata, error_section
from .render import ReportUnavailable, render_html, write_html

__all__ = ["ReportMaps", "ReportUnavailable", "audit_section", "build_report",
           "dump_metadata", "error_section", "render_html", "write_html"]
