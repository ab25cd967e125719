"""Step 3 of the audit: the plan entry behind each ring row. A slot one entry uses names it;
rows on slots outside the buffer, or on a slot several entries share, are matched by content
against the rows their candidate entries must produce."""

from __future__ import annotations

import numpy as np

from ..format.consts import EXPECTED_TOKEN_UNKNOWN, FailReason
from ..backends.reference.verify import entry_rows
from ..format.rules import violation_rows
from .launches import _Launch, _Launcher


def _attribute(rows: np.ndarray, launch: _Launch, launcher: _Launcher) -> np.ndarray:
    """Entry index of each ring row (-1 where no entry reproduces it).

    A row on a slot that exactly one entry of the launch uses belongs to that entry (its
    expected-token field must agree). Rows on a slot outside the buffer are matched by
    content against the rows their entries must produce; rows on a slot several entries
    share are matched by content against a re-check of those entries on the host reference."""
    result = np.full(rows.shape[0], -1, dtype=np.int64)
    if rows.shape[0] == 0:
        return result
    entries, num_slots = launch.entries, launcher.dump.num_slots
    row_slots = np.ascontiguousarray(rows[:, 1])
    in_range = (row_slots >= 0) & (row_slots < num_slots)
    first, last = launcher.slot_users(entries.slots)
    slot = np.where(in_range, row_slots, 0)
    candidate, earliest = np.take(last, slot), np.take(first, slot)
    # The tables outlive the launch: an entry of this launch must hold the row's slot.
    candidate = np.where(in_range & (candidate >= 0) & (candidate < launch.size), candidate,
                         0).astype(np.int64)
    used = in_range & (np.take(entries.slots, candidate) == row_slots)
    single = used & (earliest == candidate)
    expected = np.take(entries.tokens, candidate) if launch.check_token else EXPECTED_TOKEN_UNKNOWN
    single &= rows[:, 4] == expected
    result[single] = candidate[single]

    outside = np.flatnonzero(~in_range)
    if outside.size:
        result[outside] = _match_outside(rows[outside], launch)
    shared = np.flatnonzero(used & (earliest != candidate))
    if shared.size:
        result[shared] = _match_shared(rows[shared], launch, launcher)
    return result


def _match_outside(rows: np.ndarray, launch: _Launch) -> np.ndarray:
    """Rows on slots outside the buffer: such an entry's row is fixed by the entry alone."""
    e = launch.entries
    candidates = np.flatnonzero(np.isin(e.slots, np.unique(rows[:, 1])))
    tokens = e.tokens[candidates] if launch.check_token else EXPECTED_TOKEN_UNKNOWN
    predicted = violation_rows(launch.tag, e.slots[candidates], e.positions[candidates], 0,
                               tokens, 0, e.slots[candidates], int(FailReason.SLOT_OUT_OF_RANGE))
    return _match_rows(rows, predicted, candidates)


def _match_shared(rows: np.ndarray, launch: _Launch, launcher: _Launcher) -> np.ndarray:
    """Rows on slots several entries use: the candidates' rows are predicted on the host
    reference in one pass (an entry's row depends on the entry alone, so each predicted row
    names its entry) and matched by content."""
    e = launch.entries
    candidates = np.flatnonzero(np.isin(e.slots, np.unique(rows[:, 1])))
    tokens = e.tokens[candidates] if launch.check_token else np.full(
        candidates.size, EXPECTED_TOKEN_UNKNOWN, dtype=np.int64)
    context = launcher.context(launch.tag, 1, host=True)
    failed, predicted = entry_rows(context, e.slots[candidates], e.positions[candidates],
                                   e.prevs[candidates], tokens)
    return _match_rows(rows, predicted, candidates[failed])


def _occurrence(groups: np.ndarray, order_key: np.ndarray) -> np.ndarray:
    """Rank of each element among equal ``groups``, counted in ``order_key`` order."""
    order = np.lexsort((order_key, groups))
    sorted_groups = groups[order]
    rank_sorted = np.arange(order.size) - np.searchsorted(sorted_groups, sorted_groups, "left")
    rank = np.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return rank


def _row_groups(rows: np.ndarray) -> np.ndarray:
    """A group id per row, equal for identical rows (``np.unique(axis=0)`` sorts the rows as
    opaque bytes, many times slower than a lexsort of the columns)."""
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    starts = np.ones(order.size, dtype=np.int64)
    starts[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    groups = np.empty(order.size, dtype=np.int64)
    groups[order] = np.cumsum(starts) - 1
    return groups


def _match_rows(rows: np.ndarray, predicted: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """For each ring row, the entry of an identical predicted row: the k-th copy of a row
    content (ring order) takes the k-th entry predicting it (entry order); -1 if none."""
    result = np.full(rows.shape[0], -1, dtype=np.int64)
    if predicted.shape[0] == 0:
        return result
    if predicted.shape == rows.shape and np.array_equal(predicted, rows):
        return entries.astype(np.int64, copy=True)   # rows in entry order (the reference's)
    n = rows.shape[0]
    groups = _row_groups(np.concatenate([rows, predicted]))
    span = max(n, predicted.shape[0]) + 1
    row_keys = groups[:n] * span + _occurrence(groups[:n], np.arange(n))
    predicted_keys = groups[n:] * span + _occurrence(groups[n:], entries)
    order = np.argsort(predicted_keys, kind="stable")
    sorted_keys = predicted_keys[order]
    at = np.minimum(np.searchsorted(sorted_keys, row_keys), sorted_keys.size - 1)
    found = sorted_keys[at] == row_keys
    result[found] = entries[order][at[found]]
    return result


# ------------------------------------------------------------ step 4: summarise
