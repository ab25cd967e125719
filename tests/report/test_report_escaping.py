"""The HTML report shows everything it is given as text: markup in a dump's name, its
metadata, a finding's explanation or an error message comes out escaped, never as tags."""

from __future__ import annotations

import pytest

import skip_reasons

pytest.importorskip("jinja2", reason=skip_reasons.REPORT)

from kvcanary.report import build_report, error_section  # noqa: E402
from kvcanary.report.render import render_html  # noqa: E402

SCRIPT = "<script>alert(1)</script>"
IMAGE = '<img src=x onerror="alert(2)">'


def hostile_section() -> dict:
    finding = {"launch_tag": "TAIL_K_FULL", "fail_reason": "verify_position",
               "fail_reason_bits": 2, "slot_idx": 5, "position": 3, "stored_token": 1,
               "expected_token": 1, "entry": "request", "batch_index": 0, "request_row": 1,
               "expected_position": 2, "failed_checks": ["stored position " + IMAGE],
               "likely_cause": "because " + SCRIPT}
    return {"name": "dump" + SCRIPT + ".npz", "metadata": {"user_model": IMAGE, SCRIPT: "x"},
            "summary": {"violations": 1, "reported": 1, "counts_by_reason": {SCRIPT: 1}},
            "findings": [finding], "maps": None, "error": None}


def test_markup_in_names_metadata_explanations_and_errors_comes_out_as_text():
    page = render_html(build_report([hostile_section(), error_section("bad" + IMAGE, SCRIPT)]))
    assert SCRIPT not in page and IMAGE not in page
    assert "onerror=\"alert" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=" in page
