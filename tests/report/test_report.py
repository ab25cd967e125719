"""The HTML report without a browser: the maps count every row exactly (against a brute-force
count over every finding), stay bounded on a flooded dump, the page holds the summary and
findings, any findings report of the same shape renders (an explain-like one without maps),
and ``audit --html`` keeps the audit's exit codes, with one clear error for a missing extra."""

from __future__ import annotations

import base64
import json
import pathlib
import re
import shutil
import sys

import numpy as np
import pytest

import skip_reasons
from click.testing import CliRunner

import kvcanary
import kvcanary.report.maps as maps_module
from kvcanary.audit import audit
from kvcanary.cli import main
from kvcanary.dump import load
from kvcanary.report import (ReportMaps, audit_section, build_report, dump_metadata,
                             render_html, write_html)
from kvcanary.report.maps import CELL_CLEAN, CELL_EMPTY, CELL_REASON, REASON_LABELS
from report_support import (FLIPPED, PAGED_BAD, REMAPPED, flipped_slots, paged_arrays,
                            paged_bad_block, per_token_arrays, save_dump, twice_slot)

pytest.importorskip("jinja2", reason=skip_reasons.REPORT)


def decode(field, dtype=None) -> np.ndarray:
    if isinstance(field, dict):
        data, dtype = field["data"], f"<u{field['bytes']}"
    else:
        data = field
    return np.frombuffer(base64.b64decode(data), dtype=dtype).astype(np.int64)


def observed(path, **options):
    d = load(path)
    maps = ReportMaps(d)
    result = audit(d, backend="numpy", observe=maps.add, **options)
    return d, result, maps


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    arrays = per_token_arrays()
    return arrays, save_dump(tmp_path_factory.mktemp("known") / "known.npz", arrays)


def test_request_map_cells_are_the_planted_faults(known):
    arrays, path = known
    _, result, maps = observed(path)
    m = maps.to_dict()["requests"]
    grid = (m["rows"], m["columns"], m["requests_per_row"], m["positions_per_column"])
    assert grid == (4, 64, 1, 1)     # one cell per live request and position
    codes = decode(m["codes"], "u1").reshape(4, 64)
    position = CELL_REASON + REASON_LABELS.index("verify_position")
    chain = CELL_REASON + REASON_LABELS.index("verify_chain_hash")
    batch, positions = FLIPPED
    rank = {0: 0, 2: 1, 3: 2, 4: 3}          # live requests in batch order (1 is not live)
    assert set(codes[rank[batch], list(positions)]) == {position}
    assert codes[rank[batch], positions[-1] + 1] == chain   # the successor's chain link
    (b, p), _ = REMAPPED
    assert (codes[rank[b], p], codes[rank[b], p + 1]) == (position, chain)
    assert set(codes[rank[2], 40:]) == {CELL_EMPTY}          # batch index 2 has 40 positions
    assert np.count_nonzero(codes >= CELL_REASON) == result.total_violations == 19
    assert set(codes[rank[0]]) == {CELL_CLEAN}
    assert decode(m["violations"]).sum() == m["violations_total"] == 19
    assert decode(m["entries"]).sum() == result.live_entries


def test_pool_map_marks_the_slots_with_findings_and_the_slot_mapped_twice(known):
    arrays, path = known
    _, result, maps = observed(path)
    m = maps.to_dict()["pool"]
    assert m["unit"] == "slot" and m["units"] == arrays["canary"].shape[0] and m["per_cell"] == 1
    flags = decode(m["flags"], "u1")
    with_findings = set(np.flatnonzero(flags & maps_module.POOL_FINDING).tolist())
    assert with_findings == {f.violation.slot_idx for f in result.findings}
    assert flipped_slots(arrays) <= with_findings
    assert m["twice_listed"] == [twice_slot(arrays)] and m["twice_total"] == 1
    assert np.flatnonzero(flags & maps_module.POOL_TWICE).tolist() == [twice_slot(arrays)]
    assert decode(m["rows_on"]).sum() == result.total_violations
    assert m["used_total"] == np.count_nonzero(flags & maps_module.POOL_USED)


def test_a_prefix_shared_at_the_same_position_is_not_mapped_twice(tmp_path):
    arrays = per_token_arrays()
    # Batch index 2 shares batch index 0's first 8 slots (a cached prefix): same positions.
    table, rows = arrays["req_to_token"], arrays["req_pool_indices"]
    table[rows[2], :8] = table[rows[0], :8]
    _, _, maps = observed(save_dump(tmp_path / "shared.npz", arrays))
    assert maps.to_dict()["pool"]["twice_listed"] == [twice_slot(arrays)]


@pytest.mark.parametrize("chunk", [7, 50, 1 << 16])
def test_aggregated_maps_equal_a_brute_force_count(known, monkeypatch, chunk):
    """Cells covering several requests and positions (and pool cells several slots) hold
    exactly what every finding and every entry adds up to, however the launches are cut."""
    monkeypatch.setattr(maps_module, "REQUEST_MAP_ROWS", 3)
    monkeypatch.setattr(maps_module, "REQUEST_MAP_COLUMNS", 10)
    monkeypatch.setattr(maps_module, "POOL_MAP_CELLS", 13)
    arrays, path = known
    d, result, maps = observed(path, max_findings=0, chunk_entries=chunk)
    m = maps.to_dict()
    rm, pm = m["requests"], m["pool"]
    per_row, per_column = rm["requests_per_row"], rm["positions_per_column"]
    assert (rm["rows"], rm["columns"], per_row, per_column) == (2, 10, 2, 7)
    live = [b for b, row in enumerate(arrays["req_pool_indices"]) if row]
    expected = np.zeros((rm["rows"] * rm["columns"], len(REASON_LABELS)), np.int64)
    for f in result.findings:
        cell = live.index(f.batch_index) // per_row * rm["columns"] + f.position // per_column
        reason = maps_module.primary_reasons(np.array([f.violation.fail_reason_bits]))[0]
        expected[cell, reason] += 1
    assert decode(rm["violations"]).tolist() == expected.sum(axis=1).tolist()
    codes = decode(rm["codes"], "u1")
    bad = expected.sum(axis=1) > 0
    assert (codes[bad] == CELL_REASON + expected[bad].argmax(axis=1)).all()
    entries = np.zeros(rm["rows"] * rm["columns"], np.int64)
    for rank, b in enumerate(live):
        for position in range(int(arrays["seq_lens"][b])):
            entries[rank // per_row * rm["columns"] + position // per_column] += 1
    assert decode(rm["entries"]).tolist() == entries.tolist()
    per_cell = pm["per_cell"]
    rows_on = np.zeros(pm["cells"], np.int64)
    for f in result.findings:
        rows_on[f.violation.slot_idx // per_cell] += 1
    assert decode(pm["rows_on"]).tolist() == rows_on.tolist()
    assert pm["twice_listed"] == [twice_slot(arrays)]


def test_paged_pool_map_is_of_blocks(tmp_path):
    arrays = paged_arrays()
    _, result, maps = observed(save_dump(tmp_path / "paged.npz", arrays))
    m = maps.to_dict()
    assert m["requests"]["block_size"] == 16
    pool = m["pool"]
    assert pool["unit"] == "block" and pool["units"] == arrays["canary"].shape[0] // 16
    flags = decode(pool["flags"], "u1")
    assert np.flatnonzero(flags & maps_module.POOL_FINDING).tolist() == [paged_bad_block(arrays)]
    assert pool["twice_total"] == 0
    b, p = PAGED_BAD
    codes = decode(m["requests"]["codes"], "u1").reshape(m["requests"]["rows"], -1)
    assert codes[b, p] == CELL_REASON + REASON_LABELS.index("verify_position")


def test_flooded_report_stays_small_and_says_the_findings_were_cut(tmp_path):
    arrays = per_token_arrays(faults=False)
    arrays["canary"].view(np.int64)[1:, 1] ^= 1          # every record corrupt
    path = save_dump(tmp_path / "flood.npz", arrays)
    d, result, maps = observed(path, max_findings=10)
    page = render_html(build_report([audit_section(result, maps, dump_metadata(d))]))
    total = result.total_violations
    assert result.findings_cut and total == result.live_entries
    assert re.search(rf"The table lists the first 10 of {total} violations;\s+{total - 10} more "
                     "are counted", page)
    assert page.count("<tr data-reasons=") == 10


def test_map_data_is_bounded_whatever_the_dump_size():
    class Big:   # a dump's shape only: ReportMaps sizes its grids from it
        canary = np.zeros((1 << 20, 1), np.uint8)
        num_slots, block_table, block_size = 1 << 20, None, 1
        req_pool_indices = np.arange(1, 4097)
        seq_lens = np.full(4096, 256)
        batch_size = 4096

    maps = ReportMaps(Big()).to_dict()
    assert maps["requests"]["rows"] * maps["requests"]["columns"] <= (
        maps_module.REQUEST_MAP_ROWS * maps_module.REQUEST_MAP_COLUMNS)
    assert maps["pool"]["cells"] <= maps_module.POOL_MAP_CELLS
    assert len(json.dumps(maps)) < 400_000


def test_page_holds_the_summary_metadata_and_findings(known):
    arrays, path = known
    d, result, maps = observed(path)
    page = render_html(build_report([audit_section(result, maps, dump_metadata(d))]))
    assert '<span class="figure" data-key="violations">19</span>' in page
    assert '<td class="num" data-count="verify_position">17</td>' in page
    assert '<td class="num" data-count="TAIL_K_FULL">19</td>' in page
    assert page.count("<tr data-reasons=") == 19
    assert 'data-meta="layout">per-token slots<' in page
    assert 'data-meta="real_kv_hash_mode">none<' in page
    assert 'data-meta="swa_window_size">0<' in page and 'data-meta="real_kv_sources">0<' in page
    assert f'data-meta="version">{kvcanary.__version__}<' in page
    assert not re.search(r"<(script|img|iframe)[^>]*\ssrc=|<link|url\(|https?://|//[a-z]", page,
                         re.I)
    assert result.findings[0].cause in page.replace("&#39;", "'")


def test_an_explain_like_report_without_maps_renders_what_it_has(tmp_path):
    """What ``kvcanary explain --format json`` reports (summary counts, merged findings with
    explanations and fields the audit does not have; no tables, so no maps) renders as is."""
    report = build_report([{
        "name": "server.log",
        "summary": {"violations": 3, "findings": 1, "counts_by_tag": {"TAIL_K_FULL": 3},
                    "lower_bound": True},
        "findings": [{"launch_tag": "TAIL_K_FULL", "fail_reason": "verify_real_kv_hash",
                      "slot_idx": 42, "position": 7, "count": 3, "first_step": 11,
                      "explanation": "the KV bytes of slot 42 changed after the write"}],
        "notes": ["one position across many slots"], "unknown_part": {"x": 1}}],
        command="explain")
    out = write_html(report, str(tmp_path / "explain.html"))
    page = pathlib.Path(out).read_text(encoding="utf-8")
    assert "kvcanary explain" in page and "<canvas" not in page
    assert "the KV bytes of slot 42 changed after the write" in page
    assert "count=3; first_step=11" in page
    assert 'data-summary="lower_bound">yes<' in page
    assert 'data-count="TAIL_K_FULL">3<' in page
    assert "<li>one position across many slots</li>" in page
    bare = render_html(build_report([{"name": "x.log", "findings": [{"slot_idx": 1}]}]))
    assert "data-verdict" not in bare and "<td>1</td>" in bare


def test_the_documented_python_example_writes_the_page(known, tmp_path, monkeypatch):
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    code = re.search(r"From Python, `kvcanary.report`.*?```\n(.*?)```", text, re.S).group(1)
    shutil.copy(known[1], tmp_path / "dump.npz")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/cli.md", "exec"), {})
    page = (tmp_path / "report.html").read_text()
    assert '<span class="figure" data-key="violations">19</span>' in page


def test_the_docs_screenshot_is_the_demo_report_with_its_maps():
    from browser import decode_png

    docs = pathlib.Path(__file__).resolve().parents[2] / "docs"
    assert "](report.png)" in (docs / "cli.md").read_text()
    image = decode_png((docs / "report.png").read_bytes())
    assert image.shape[1] >= 1000 and image.shape[0] >= 900
    # The map's cells: the clean green and a reason's red are both in the picture.
    for colour in ((0xc9, 0xdc, 0xcb), (0xd7, 0x30, 0x1f)):
        assert np.all(image == colour, axis=2).sum() > 50, colour


# ------------------------------------------------------------------ the command line


def run_cli(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_cli_html_keeps_the_exit_codes(known, tmp_path):
    arrays, path = known
    page = tmp_path / "r.html"
    result = run_cli("audit", path, "--backend", "numpy", "--html", str(page))
    assert result.exit_code == 1 and f"html report: {page}" in result.output
    assert page.stat().st_size > 0
    clean_path = save_dump(tmp_path / "clean.npz", per_token_arrays(faults=False))
    result = run_cli("audit", clean_path, "--backend", "numpy", "--html", str(page))
    assert result.exit_code == 0, result.output
    assert 'data-verdict="clean"' in page.read_text()


def test_cli_html_with_a_bad_dump_shows_it_and_exits_2(known, tmp_path):
    _, path = known
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a dump")
    page = tmp_path / "r.html"
    result = run_cli("audit", path, str(bad), "--backend", "numpy", "--html", str(page),
                     "--format", "json", "-j", "1")
    assert result.exit_code == 2
    text = page.read_text()
    assert text.count('<section class="input"') == 2 and 'data-verdict="error"' in text
    assert "bad.npz" in text and "1 with violations, 1 not audited" in text
    assert json.loads(result.stdout.splitlines()[-1])["record"] == "total"


def test_cli_html_without_the_extra_is_one_clear_error(known, tmp_path, monkeypatch):
    _, path = known
    monkeypatch.setitem(sys.modules, "jinja2", None)     # import jinja2 now fails
    page = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["audit", path, "--html", str(page)])
    assert result.exit_code == 2
    assert result.output.strip() == ("kvcanary: error: a needed package is missing: the HTML "
                                     "report needs jinja2: pip install 'kvcanary[report]'")
    assert not page.exists()


def test_cli_html_to_a_missing_directory_is_exit_2(known, tmp_path):
    _, path = known
    result = CliRunner().invoke(main, ["audit", path, "--backend", "numpy", "--html",
                                       str(tmp_path / "nowhere" / "r.html")])
    assert result.exit_code == 2
    assert result.output.splitlines()[-1].startswith("kvcanary: error: ")
    assert "Traceback" not in result.output


def test_padding_slot_zero_is_a_finding_not_a_slot_mapped_twice(tmp_path):
    arrays = per_token_arrays(faults=False)
    row = arrays["req_pool_indices"][0]
    arrays["req_to_token"][row, [3, 5]] = 0
    _, result, maps = observed(save_dump(tmp_path / "zero.npz", arrays))
    pool = maps.to_dict()["pool"]
    assert result.counts_by_reason["slot_zero_in_prefix"] == 2
    assert pool["twice_total"] == 0
    assert decode(pool["flags"], "u1")[0] & maps_module.POOL_FINDING


def test_nested_fields_are_shown_in_words_not_as_python_reprs(tmp_path):
    """A diagnosis's ``related`` entries (a list of dicts) read as words in the details."""
    report = build_report([{
        "name": "d.npz",
        "findings": [{"launch_tag": "TAIL_K_FULL", "fail_reason": "verify_position",
                      "slot_idx": 12, "position": 2, "likely_cause": "shifted",
                      "diagnosis": {"cause": "shifted-mapping", "certain": True,
                                    "related": [{"request_row": 6, "position": 2}]}}]}],
        command="audit")
    page = pathlib.Path(write_html(report, str(tmp_path / "r.html"))).read_text("utf-8")
    assert "{&#39;" not in page and "{'" not in page and "[{" not in page
    assert "related (request row 6, position 2)" in page
