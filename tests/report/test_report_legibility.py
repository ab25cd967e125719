"""The report reads for everyone: every text colour of the page's stylesheet against its
background meets WCAG's 4.5:1; in each map, two states whose fills are closer than 3:1 (they
differ in hue only, or little in lightness) also differ in the mark drawn over them, and every
mark stands out 3:1 from its fill; the page draws with those tables; and no label of a
section's details is shown twice."""

from __future__ import annotations

import itertools
import json
import pathlib
import re

import pytest

import skip_reasons

from kvcanary.report import audit_section, build_report, dump_metadata, render_html
from kvcanary.report.maps import REASON_LABELS
from kvcanary.report.palette import (MARKS, NON_TEXT_CONTRAST, POOL_STATES, REQUEST_STATES,
                                     TEXT_CONTRAST, contrast, ink, luminance)

pytest.importorskip("jinja2", reason=skip_reasons.REPORT)

CSS = (pathlib.Path(__file__).resolve().parents[2] / "kvcanary" / "report" / "templates"
       / "report.css").read_text()


def test_contrast_is_wcag_arithmetic():
    assert contrast("#000000", "#ffffff") == pytest.approx(21.0)
    assert contrast("#777777", "#ffffff") == pytest.approx(4.48, abs=0.01)
    assert luminance("#ffffff") == pytest.approx(1.0)


def css_rules() -> list:
    """``(selector, {property: value})`` of each rule, ``var(--x)`` resolved from ``:root``."""
    rules = [(sel.strip(), dict(re.findall(r"([\w-]+)\s*:\s*([^;]+)", body)))
             for sel, body in re.findall(r"([^{}]+)\{([^}]*)\}", CSS)]
    root = next(props for sel, props in rules if sel == ":root")

    def resolve(value):
        return re.sub(r"var\((--[\w-]+)\)", lambda m: root[m.group(1)].strip(), value).strip()
    return [(sel, {k: resolve(v) for k, v in props.items()}) for sel, props in rules]


def text_pairs() -> list:
    """Every rule that sets a text colour or a background, with the other (its own, or the
    page's)."""
    rules = css_rules()
    body = dict(rules)["body"]
    pairs = []
    for selector, props in rules:
        background = props.get("background", "none")
        if background in ("none", "transparent"):     # it shows the page's
            background = body["background"]
        if "color" in props or re.fullmatch(r"#[0-9a-f]{6}", background):
            pairs.append((selector, props.get("color", body["color"]), background))
    return pairs


def test_every_text_colour_has_wcag_contrast_on_its_background():
    pairs = text_pairs()
    assert len(pairs) >= 6       # ink, muted, the three verdicts, the tooltip ...
    for selector, colour, background in pairs:
        assert re.fullmatch(r"#[0-9a-f]{6}", colour) and re.fullmatch(r"#[0-9a-f]{6}",
                                                                      background), selector
        assert contrast(colour, background) >= TEXT_CONTRAST, (selector, colour, background)


@pytest.mark.parametrize("states", [REQUEST_STATES, POOL_STATES], ids=["requests", "pool"])
def test_states_closer_than_three_to_one_differ_in_their_mark(states):
    for (a, (fill_a, mark_a)), (b, (fill_b, mark_b)) in itertools.combinations(states.items(), 2):
        assert fill_a != fill_b, (a, b)
        if contrast(fill_a, fill_b) < NON_TEXT_CONTRAST:
            assert mark_a != mark_b, (a, b, contrast(fill_a, fill_b))
    for name, (fill, mark) in states.items():
        assert mark in MARKS, name
        if mark != "plain":
            assert contrast(ink(fill), fill) >= NON_TEXT_CONTRAST, name


def test_a_finding_stands_out_from_a_clean_cell_by_colour_or_mark():
    clean_fill, clean_mark = REQUEST_STATES["checked, clean"]
    for reason in REASON_LABELS:
        fill, mark = REQUEST_STATES[reason]
        assert contrast(fill, clean_fill) >= NON_TEXT_CONTRAST or mark != clean_mark, reason
    used_fill, used_mark = POOL_STATES["used, no finding"]
    for name in ("with findings", "mapped twice", "both"):
        fill, mark = POOL_STATES[name]
        assert contrast(fill, used_fill) >= NON_TEXT_CONTRAST or mark != used_mark, name


def test_the_page_draws_with_the_checked_tables_and_no_colour_of_its_own(tmp_path):
    from report_support import per_token_arrays, save_dump
    from test_report import observed

    dump, result, maps = observed(save_dump(tmp_path / "k.npz", per_token_arrays()))
    page = render_html(build_report([audit_section(result, maps, dump_metadata(dump))]))
    palette = json.loads(re.search(r'<script type="application/json" id="palette">(.*?)</script>',
                                   page, re.S).group(1))
    for key, states in (("requests", REQUEST_STATES), ("pool", POOL_STATES)):
        assert {name: (s["fill"], s["mark"]) for name, s in palette[key].items()} == states
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    assert not re.search(r"#[0-9a-fA-F]{6}\b", script)      # every fill comes from the tables
    # Every reason the maps can name has a state of its own.
    assert set(REASON_LABELS) <= set(REQUEST_STATES)


def details_labels(page: str, section: int = 0) -> list:
    body = page.split('<section class="input"')[1 + section]
    table = body.split('<table class="plain meta">')[1].split("</table>")[0]
    return re.findall(r'<th scope="row">([^<]*)</th>', table)


def test_no_detail_of_a_sweep_dump_is_listed_twice(tmp_path):
    from report_support import save_dump, sweep_only_arrays
    from test_report import observed

    dump, result, maps = observed(save_dump(tmp_path / "s.npz", sweep_only_arrays()))
    page = render_html(build_report([audit_section(result, maps, dump_metadata(dump))]))
    labels = details_labels(page)
    assert labels.count("sweep entries") == 1
    assert len(labels) == len(set(labels)), labels
