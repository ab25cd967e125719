"""The report maps' colours and marks, and the contrast arithmetic that checks them.

The fills are Paul Tol's "muted" qualitative scheme (chosen to stay apart under the common
colour-vision deficiencies), white and Tol's pale grey for the quiet states. Colour is never
the only cue: two states of one map whose fills are closer than :data:`NON_TEXT_CONTRAST`
(WCAG's ratio for graphics) also differ in the mark drawn over the fill, and every state has
its name in the legend and in the tooltip of each cell.

The page reads :func:`page_palette` (inline JSON); the tests read the same tables.
"""

from __future__ import annotations

# WCAG 2 ratios: body text against its background, and graphics (a map cell against its
# neighbour, a mark against its fill).
TEXT_CONTRAST = 4.5
NON_TEXT_CONTRAST = 3.0

# Marks the page can draw in a cell of at least MIN_CELL_PX pixels a side.
MARKS = ("plain", "slash", "backslash", "cross", "dot", "hbar", "vbar", "plus", "frame")
MIN_CELL_PX = 5
BLACK, WHITE = "#000000", "#ffffff"

# Request map: state -> (fill, mark). The reason states are named by their labels.
REQUEST_STATES = {
    "nothing checked": ("#ffffff", "slash"),
    "checked, clean": ("#dddddd", "plain"),
    "slot_out_of_range": ("#332288", "plain"),
    "slot_zero_in_prefix": ("#882255", "dot"),
    "verify_position": ("#cc6677", "backslash"),
    "verify_token": ("#ddcc77", "dot"),
    "verify_chain_hash": ("#999933", "hbar"),
    "verify_real_kv_hash": ("#44aa99", "vbar"),
    "write_token": ("#88ccee", "cross"),
    "write_position": ("#117733", "cross"),
    "write_slot_conflict": ("#aa4499", "plus"),
    "other": ("#555555", "frame"),
}
# Pool map: state -> (fill, mark).
POOL_STATES = {
    "not used by a checked entry": ("#ffffff", "slash"),
    "used, no finding": ("#dddddd", "plain"),
    "with findings": ("#cc6677", "dot"),
    "mapped twice": ("#ddcc77", "backslash"),
    "both": ("#882255", "plain"),
}
# The hatching of an empty cell is a quiet grey, not black (still NON_TEXT_CONTRAST on white).
INK_OVERRIDES = {"#ffffff": "#8c8c8c"}


def luminance(colour: str) -> float:
    """WCAG relative luminance of ``#rrggbb``."""
    value = colour.lstrip("#")
    channels = [int(value[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(first: str, second: str) -> float:
    """WCAG contrast ratio of two colours (1 to 21)."""
    low, high = sorted((luminance(first), luminance(second)))
    return (high + 0.05) / (low + 0.05)


def ink(fill: str) -> str:
    """The colour a mark is drawn in over ``fill``: black or white, whichever stands out more."""
    if fill in INK_OVERRIDES:
        return INK_OVERRIDES[fill]
    return BLACK if contrast(fill, BLACK) >= contrast(fill, WHITE) else WHITE


def page_palette() -> dict:
    """What the page's script draws with: per map, state -> ``{fill, mark, ink}``."""
    def table(states):
        return {name: {"fill": fill, "mark": mark, "ink": ink(fill)}
                for name, (fill, mark) in states.items()}
    return {"requests": table(REQUEST_STATES), "pool": table(POOL_STATES),
            "min_cell_px": MIN_CELL_PX}
