"""The transformers guard's allocator history (integrations/transformers/history.py) on a
stand-in allocator: only a new or changed block table is looked at, and a changed one is
never missed (a remapped entry, a grown table, a block freed while held)."""

from __future__ import annotations

import pytest

from kvcanary.findings.causes import Cause
from kvcanary.integrations.transformers.history import AllocatorHistory

pytest.importorskip("transformers", reason="the history hashes blocks as transformers does")


class _Free:
    def __init__(self):
        self.trees = {}


class _Pool:
    def __init__(self):
        self._free_blocks = [_Free()]


class _Ledger:
    block_to_hash: dict = {}


class _Allocator:
    tokens_per_page, index = 4, 0

    def __init__(self):
        self.block_table, self.pool, self.ledger = {}, _Pool(), _Ledger()


def test_changed_tables_are_seen_and_unchanged_ones_kept():
    a = _Allocator()
    h = AllocatorHistory(a)
    a.block_table = {"a": [5, 6], "b": [8]}
    h.observe(0, lambda rid: None)
    assert h.got["a"] == {5: (0, "allocated"), 6: (0, "allocated")}
    a.block_table["a"] = [5, 7]                  # entry 1 remapped, b unchanged
    h.observe(1, lambda rid: None)
    assert h.got["a"][7] == (1, "remapped") and h.got["b"] == {8: (0, "allocated")}
    a.block_table["a"].append(9)                 # the same list, grown in place
    h.observe(2, lambda rid: None)
    assert h.got["a"][9] == (2, "allocated")
    a.pool._free_blocks[0].trees = {2: [8, 11]}  # b's block back in the pool while held
    h.observe(3, lambda rid: None)
    h.observe(4, lambda rid: None)               # nothing changed: nothing noted again
    assert h.events[8] == [(3, "freed", ("b",), ())]
    assert h.cause("a", 7, None).cause is Cause.REMAPPED
    assert h.cause("b", 8, None).cause is Cause.FREED_WHILE_HELD
    del a.block_table["b"]                       # b finished: what it kept goes
    h.observe(5, lambda rid: None)
    assert set(h.got) == {"a"} and set(h.tables) == {"a"}
