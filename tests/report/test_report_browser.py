"""The HTML report in a real browser: the system's Chromium, headless, driven over the DevTools
protocol. The page loads from a file with no console error and no network request; its DOM
holds the audit's counts and findings; sorting and filtering work; a screenshot has the maps
where they should be, the planted faults in the reason's colour at their request and
position, and block boundaries on a paged dump. Without Chromium these tests skip."""

from __future__ import annotations

import json

import numpy as np
import pytest

import skip_reasons
from click.testing import CliRunner

from browser import Browser, find_chromium
from kvcanary.audit import audit
from kvcanary.cli import main
from kvcanary.report.palette import POOL_STATES, REQUEST_STATES, ink
from report_support import (FLIPPED, REMAPPED, paged_arrays, paged_bad_block, per_token_arrays,
                            save_dump, sweep_only_arrays, twice_slot)

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium not found (the report's "
                                "browser tests need the distribution's chromium package)")
pytest.importorskip("jinja2", reason=skip_reasons.REPORT)



def rgb(colour: str) -> tuple:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


# The page's fills (kvcanary/report/palette.py), as RGB.
VERIFY_POSITION = rgb(REQUEST_STATES["verify_position"][0])
CLEAN = rgb(REQUEST_STATES["checked, clean"][0])
EMPTY = rgb(REQUEST_STATES["nothing checked"][0])
POOL_TWICE_AND_FINDING = rgb(POOL_STATES["both"][0])
POOL_USED = rgb(POOL_STATES["used, no finding"][0])
POOL_FINDING = rgb(POOL_STATES["with findings"][0])


def write_report(tmp_path, name: str, arrays: dict) -> tuple:
    dump = save_dump(tmp_path / f"{name}.npz", arrays)
    page = tmp_path / f"{name}.html"
    result = CliRunner().invoke(main, ["audit", dump, "--backend", "numpy", "--max-findings",
                                       "0", "--html", str(page)])
    assert result.exit_code == 1, result.output
    return dump, page.as_uri()


def open_report(tmp_path, browser, name: str, arrays: dict):
    """The report of ``arrays`` loaded, after checking it loaded cleanly and offline."""
    _, url = write_report(tmp_path, name, arrays)
    page = browser.open(url)
    assert page.console_errors == [] and page.requests == [url]
    return page


@pytest.fixture(scope="module")
def browser():
    with Browser(CHROMIUM) as b:
        yield b


@pytest.fixture(scope="module")
def known(tmp_path_factory, browser):
    arrays = per_token_arrays()
    dump, url = write_report(tmp_path_factory.mktemp("known"), "known", arrays)
    return arrays, dump, url, browser.open(url)


def test_page_loads_offline_with_no_console_error_and_no_request(known):
    _, _, url, page = known
    assert page.console_errors == []
    assert page.requests == [url]          # the page itself, and nothing else
    assert page.evaluate("document.readyState") == "complete"


def test_dom_holds_the_counts_and_the_findings(known):
    _, _, _, page = known
    dom = page.evaluate("""(() => {
        const q = (s) => document.querySelector(s), all = (s) => document.querySelectorAll(s);
        return {violations: q('[data-key=violations]').textContent,
                entries: q('[data-key=entries_checked]').textContent,
                verdict: q('.verdict').dataset.verdict,
                position: q('[data-counts=counts_by_reason] [data-count=verify_position]').textContent,
                tag: q('[data-counts=counts_by_tag] [data-count=TAIL_K_FULL]').textContent,
                rows: all('table.findings tbody tr').length,
                positionRows: all('table.findings tr[data-reasons~=verify_position]').length,
                twice: q('[data-key=twice_total]').textContent,
                requests: all('[data-list=requests] tbody tr').length,
                layout: q('[data-meta=layout]').textContent,
                shown: q('.shown').textContent};
    })()""")
    assert dom == {"violations": "19", "entries": "232", "verdict": "violations",
                   "position": "17", "tag": "19", "rows": 19, "positionRows": 17, "twice": "1",
                   "requests": 2, "layout": "per-token slots", "shown": "19 of 19 shown"}


def test_findings_table_sorts_and_filters(known):
    _, dump, _, page = known
    slots = page.evaluate("""(() => {
        const table = document.querySelector('table.findings');
        const heads = [...table.tHead.rows[0].cells].map((th) => th.textContent);
        const slot = heads.indexOf('slot');
        table.tHead.rows[0].cells[slot].click();
        return [...table.tBodies[0].rows].map((r) => Number(r.cells[slot].textContent));
    })()""")
    assert len(slots) == 19 and slots == sorted(slots)
    filtered = page.evaluate("""(() => {
        const s = document.querySelector('.filter-text');
        s.value = 'ONLY THE CHAIN LINK'; s.dispatchEvent(new Event('input'));
        const byText = [...document.querySelectorAll('table.findings tbody tr:not([hidden])')].length;
        s.value = ''; s.dispatchEvent(new Event('input'));
        const r = document.querySelector('.filter-reason');
        r.value = 'verify_position'; r.dispatchEvent(new Event('input'));
        const visible = [...document.querySelectorAll('table.findings tbody tr:not([hidden])')];
        const result = [byText, visible.length, document.querySelector('.shown').textContent,
                        visible.every((tr) => tr.dataset.reasons.split(' ').includes('verify_position'))];
        r.value = ''; r.dispatchEvent(new Event('input'));
        return result;
    })()""")
    assert filtered[1:] == [17, "17 of 19 shown", True]
    # The text filter ignores case: the findings whose explanation says so.
    result = audit(dump, backend="numpy", max_findings=0)
    assert filtered[0] == sum("only the chain link" in f.cause for f in result.findings) == 2


def canvas_cells(page, selector: str) -> tuple:
    """The canvas's place on the page and its cell size, and its screenshot."""
    box = page.evaluate(f"""(() => {{
        const c = document.querySelector('{selector}'), r = c.getBoundingClientRect();
        return {{x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width,
                height: r.height, cw: Number(c.dataset.cellWidth), ch: Number(c.dataset.cellHeight),
                border: c.clientLeft, lines: c.dataset.blockLines}};
    }})()""")
    image = page.screenshot({k: box[k] for k in ("x", "y", "width", "height")})
    return box, image


def cell_image(image, box, row: int, column: int) -> np.ndarray:
    """The pixels of one cell, ``(ch, cw, 3)``."""
    y = box["border"] + row * box["ch"]
    x = box["border"] + column * box["cw"]
    return image[y:y + box["ch"], x:x + box["cw"]]


def pixel(image, box, row: int, column: int) -> tuple:
    """The colour most of a cell's pixels have (its fill: the mark over it is thin)."""
    pixels = cell_image(image, box, row, column).reshape(-1, 3)
    colours, counts = np.unique(pixels, axis=0, return_counts=True)
    return tuple(int(v) for v in colours[counts.argmax()])


def pool_pixel(page, unit: int) -> tuple:
    """The colour of the pool-map cell of a slot (or block), one unit per cell."""
    box, image = canvas_cells(page, "canvas.pool-map")
    pool = json.loads(page.evaluate("document.querySelector('script.map-data').textContent"))
    assert pool["pool"]["per_cell"] == 1
    columns = pool["pool"]["columns"]
    return pixel(image, box, unit // columns, unit % columns)


def near(colour, expected, tolerance=6) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(colour, expected))


def test_screenshot_has_the_request_map_where_it_should_be(known):
    _, _, _, page = known
    layout = page.evaluate("""(() => {
        const top = (s) => document.querySelector(s).getBoundingClientRect().top + window.scrollY;
        return {verdict: top('.verdict'), map: top('canvas.request-map'), pool: top('canvas.pool-map'),
                findings: top('table.findings')};
    })()""")
    assert layout["verdict"] < layout["map"] < layout["pool"] < layout["findings"]
    box, image = canvas_cells(page, "canvas.request-map")
    assert image.shape[:2] == (round(box["height"]), round(box["width"]))
    batch, positions = FLIPPED
    rank = {0: 0, 2: 1, 3: 2, 4: 3}
    for position in positions:
        assert near(pixel(image, box, rank[batch], position), VERIFY_POSITION), position
    assert near(pixel(image, box, rank[batch], 10), CLEAN)
    assert near(pixel(image, box, rank[0], 40), CLEAN)
    assert near(pixel(image, box, rank[2], 50), EMPTY)        # batch index 2 ends at 40
    (b, p), _ = REMAPPED
    assert near(pixel(image, box, rank[b], p), VERIFY_POSITION)
    # Nothing else has verify_position's fill: 16 + 1 cells.
    rows = (round(box["height"]) - 2 * box["border"]) // box["ch"]
    columns = (round(box["width"]) - 2 * box["border"]) // box["cw"]
    assert sum(near(pixel(image, box, r, c), VERIFY_POSITION)
               for r in range(rows) for c in range(columns)) == 17


def test_screenshot_of_the_pool_marks_the_slot_mapped_twice(known):
    arrays, _, _, page = known
    slot = twice_slot(arrays)                                  # it holds a finding too
    assert near(pool_pixel(page, slot), POOL_TWICE_AND_FINDING)
    used = int(arrays["req_to_token"][1, 0])                   # batch index 0, position 0
    assert near(pool_pixel(page, used), POOL_USED)


def test_paged_report_draws_block_boundaries_and_the_block_map(tmp_path, browser):
    arrays = paged_arrays()
    page = open_report(tmp_path, browser, "paged", arrays)
    box, image = canvas_cells(page, "canvas.request-map")
    assert box["lines"] == "drawn"
    # Row 0 is clean: at a block boundary (position 16) the column is darker than inside.
    y = box["border"] + box["ch"] // 2
    boundary = box["border"] + 16 * box["cw"]
    inside = box["border"] + 8 * box["cw"]
    assert image[y, boundary].sum() < image[y, inside].sum() - 60
    assert near(tuple(int(v) for v in image[y, inside]), CLEAN)
    pool = json.loads(page.evaluate("document.querySelector('script.map-data').textContent"))
    assert pool["pool"]["unit"] == "block"
    assert page.evaluate("document.querySelector('h3 + p + .map-wrap ~ h3').textContent") == "Blocks"
    assert near(pool_pixel(page, paged_bad_block(arrays)), POOL_FINDING)


def test_a_dump_with_only_sweep_entries_has_no_request_map(tmp_path, browser):
    page = open_report(tmp_path, browser, "sweep", sweep_only_arrays())
    dom = page.evaluate("""({requestMaps: document.querySelectorAll('canvas.request-map').length,
                             poolMaps: document.querySelectorAll('canvas.pool-map').length,
                             entries: document.querySelector('[data-counts=counts_by_entry]').textContent,
                             rows: document.querySelectorAll('table.findings tbody tr').length})""")
    assert dom["requestMaps"] == 0 and dom["poolMaps"] == 1
    assert "sweep" in dom["entries"] and dom["rows"] >= 1


def test_explain_report_of_an_sglang_log_loads_with_its_findings_and_patterns(tmp_path, browser):
    import pathlib

    log = pathlib.Path(__file__).resolve().parents[1] / "data" / "explain" / "decode.log"
    page_path = tmp_path / "explain.html"
    result = CliRunner().invoke(main, ["explain", str(log), "--html", str(page_path)])
    assert result.exit_code == 1, result.output
    url = page_path.as_uri()
    page = browser.open(url)
    assert page.console_errors == [] and page.requests == [url]
    dom = page.evaluate("""(() => ({
        rows: document.querySelectorAll('table.findings tbody tr').length,
        notes: Array.from(document.querySelectorAll('ul.notes li')).map(li => li.textContent),
        text: document.body.textContent}))()""")
    assert dom["rows"] == 12             # the log's 160 rows merge into 12 distinct findings
    assert any(n.startswith("pattern ring-overflow") for n in dom["notes"])
    assert "172 violations reported, 160 rows logged" in dom["text"]


def row_labels(page, selector: str) -> list:
    return page.evaluate(f"""(() => {{
        const c = document.querySelector('{selector}'), wrap = c.closest('.map-wrap');
        const top = c.getBoundingClientRect().top + c.clientTop;
        return [...wrap.querySelectorAll('.row-label')].map((l) => ({{
            first: Number(l.dataset.first), last: Number(l.dataset.last), text: l.textContent,
            top: l.getBoundingClientRect().top - top, height: l.getBoundingClientRect().height,
            visible: l.scrollWidth <= l.clientWidth + 1}}));
    }})()""")


@pytest.mark.parametrize("selector", ["canvas.request-map", "canvas.pool-map"])
def test_every_map_row_has_a_label_beside_it(known, selector):
    _, _, _, page = known
    box = page.evaluate(f"""(() => {{ const c = document.querySelector('{selector}');
        return {{rows: c.height / Number(c.dataset.cellHeight), ch: Number(c.dataset.cellHeight)}}; }})()""")
    rows = box["rows"]
    labels = row_labels(page, selector)
    covered = [r for label in labels for r in range(label["first"], label["last"] + 1)]
    assert covered == list(range(rows))                  # each row in exactly one label
    for label in labels:
        assert label["text"] and label["visible"], label
        assert label["top"] == pytest.approx(label["first"] * box["ch"], abs=1)
        assert label["height"] == pytest.approx((label["last"] - label["first"] + 1) * box["ch"],
                                                abs=1)
    title = page.evaluate(f"document.querySelector('{selector}').closest('.map-wrap')"
                          ".querySelector('.row-title').textContent")
    if selector == "canvas.request-map":                 # one live request per row
        assert title == "live request (request row)"
        assert [label["text"] for label in labels] == ["0 (row 1)", "1 (row 3)", "2 (row 4)",
                                                       "3 (row 5)"]
    else:                                                # the first and last slot of each band
        assert title == "slots"
        pool = json.loads(page.evaluate("document.querySelector('script.map-data').textContent"))
        per_label = pool["pool"]["columns"] * (labels[0]["last"] + 1)
        assert labels[0]["text"] == f"0\u2013{per_label - 1}"
        assert labels[-1]["text"].endswith(f"\u2013{pool['pool']['units'] - 1}")


def test_a_cell_and_its_legend_swatch_carry_the_states_mark(known):
    _, _, _, page = known
    batch, positions = FLIPPED                                     # rank 2: batch index 3
    drawn = page.evaluate(f"""(() => {{
        const c = document.querySelector('canvas.request-map');
        const cw = Number(c.dataset.cellWidth), ch = Number(c.dataset.cellHeight);
        const d = c.getContext('2d').getImageData({positions[0]} * cw, 2 * ch, cw, ch).data, px = [];
        for (let i = 0; i < d.length; i += 4) px.push([d[i], d[i + 1], d[i + 2]]);
        return {{cw, ch, px}};
    }})()""")
    box = {"cw": drawn["cw"], "ch": drawn["ch"]}
    cell = np.array(drawn["px"]).reshape(box["ch"], box["cw"], 3)
    fill, mark = REQUEST_STATES["verify_position"]
    assert mark == "backslash"
    ink_pixels = np.all(np.abs(cell - rgb(ink(fill))) <= 6, axis=2)
    diagonal = np.array([[x == y for x in range(box["cw"])] for y in range(box["ch"])])
    assert ink_pixels.any() and np.array_equal(ink_pixels, ink_pixels & diagonal)
    # Each legend swatch shows its state's mark: ink pixels unless the mark is plain.
    swatches = page.evaluate("""[...document.querySelectorAll('canvas.swatch')].map((c) => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, px = [];
        for (let i = 0; i < d.length; i += 4) px.push([d[i], d[i + 1], d[i + 2]]);
        return {state: c.dataset.state, map: c.closest('.map-wrap').querySelector('canvas.map').dataset.map, px};
    })""")
    assert {s["state"] for s in swatches if s["map"] == "pool"} == set(POOL_STATES)
    for swatch in swatches:
        states = REQUEST_STATES if swatch["map"] == "requests" else POOL_STATES
        fill, mark = states[swatch["state"]]
        inked = sum(near(p, rgb(ink(fill)), 2) for p in swatch["px"])
        assert (inked > 0) == (mark != "plain"), swatch["state"]
