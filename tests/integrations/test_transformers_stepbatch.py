"""The transformers guard's step as arrays (integrations/transformers/stepbatch.py): the
slot grid, the read-index override, the expected tokens and the token cache give, for a
whole batch at once, exactly what the per-request formulas give. numpy only (no torch)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcanary.integrations.transformers.stepbatch import BlockTables, StepBatch, TokenCache

PAGE, MISSING = 4, 10_000


class _State:
    def __init__(self, initial, generated=()):
        self.initial_tokens, self.generated_tokens = list(initial), list(generated)


class _Rec:
    def __init__(self, name):
        self.request_id = name


def _one_table(blocks, length, window=None):
    """The per-request formula: the slot of each position [0, length)."""
    out = []
    for p in range(length):
        ring = p % window if window else p
        i = ring // PAGE
        out.append(blocks[i] * PAGE + ring % PAGE if i < len(blocks) else MISSING)
    return out


@pytest.mark.parametrize("window", [None, 6])
def test_slot_grid_is_each_requests_table(window):
    rng = np.random.default_rng(1)
    lists = [list(rng.integers(1, 500, size=k)) for k in (0, 1, 3, 7, 2)]
    lists[2] = tuple(lists[2])                     # the engine's lists or tuples alike
    width = 31
    positions = np.arange(width) % window if window else np.arange(width)
    grid = BlockTables(lists).grid(positions // PAGE, positions % PAGE, PAGE, MISSING)
    assert grid.shape == (len(lists), width) and grid.dtype == np.int64
    for row, blocks in zip(grid.tolist(), lists):
        assert row == _one_table(list(blocks), width, window)


def test_slot_grid_without_any_block():
    grid = BlockTables([(), ()]).grid(np.arange(3), np.arange(3), PAGE, MISSING)
    assert grid.tolist() == [[MISSING] * 3] * 2


def _batch(pasts, queries, engine_pasts, token_lists):
    n = len(pasts)
    past = np.array(pasts, dtype=np.int64)
    query = np.array(queries, dtype=np.int64)
    engine_past = np.array(engine_pasts, dtype=np.int64)
    width = int((np.maximum(past, engine_past) + query).max()) + 1
    table = np.arange(n * width, dtype=np.int64).reshape(n, width) + 100
    views = [np.array(t, dtype=np.int64) for t in token_lists]
    return StepBatch([_Rec(f"r{i}") for i in range(n)], query, engine_past, past, table,
                     views)


def test_expected_tokens_and_pool_per_request():
    tokens = [[5, 6, 7, 8, 9], [1, 2], [3, 4, 5, 6, 7, 8, 9, 10]]
    b = _batch([4, 1, 6], [1, 3, 2], [4, 1, 6], tokens)
    positions = b.past[b.owners] + b.entry
    assert b.owners.tolist() == [0, 1, 1, 1, 2, 2]
    assert positions.tolist() == [4, 1, 2, 3, 6, 7]
    # past the request's tokens: -1 (the write then compares nothing there)
    assert b.expected_tokens(positions).tolist() == [9, 2, -1, -1, 9, 10]
    pool, valid = b.token_pool(6)
    assert valid.tolist() == [5, 2, 6]
    assert pool.tolist() == [[-1] * 6, [5, 6, 7, 8, 9, -1], [1, 2, -1, -1, -1, -1],
                             [3, 4, 5, 6, 7, 8]]
    # each request's table from its own row, and its slots from a start per request
    assert b.table_of(1).tolist() == b.table[1, :5].tolist()
    assert b.slots_from(b.past).tolist() == [b.table[i, p] for i, p in
                                             zip(b.owners.tolist(), positions.tolist())]


def test_read_indices_override_per_request():
    """Each request's read indices (laid out one request after another) replace the table's
    slots of its cached positions; a short read list covers what it reaches only."""
    b = _batch([3, 2, 4], [1, 1, 1], [3, 2, 4], [[0] * 5] * 3)
    count, first = b.engine_past + b.query, np.zeros(3, dtype=np.int64)
    read_all = np.arange(1, 13, dtype=np.int64) * -1          # 4 + 3 + 5 would be 12
    b.read_from(read_all[:10], count, first, 0)
    assert b.read[0, :3].tolist() == [-1, -2, -3]
    assert b.read[1, :2].tolist() == [-5, -6]
    assert b.read[2, :4].tolist() == [-8, -9, -10, b.table[2, 3]]   # the list ran out
    assert b.read is not b.table and b.table[0, 0] == 100
    # a window keeps only the last cached positions
    w = _batch([5], [1], [5], [[0] * 6])
    w.read_from(np.arange(1, 7, dtype=np.int64) * -1, np.array([6]), np.array([0]), 2)
    assert w.read[0, :5].tolist() == [w.table[0, 0], w.table[0, 1], w.table[0, 2], -4, -5]


def test_token_cache_follows_the_engines_lists():
    cache, state = TokenCache(), _State(range(10, 20))
    assert cache.tokens(state).tolist() == list(range(10, 20))
    for t in range(40):                     # appended one by one, the buffer grows
        state.generated_tokens.append(t)
        assert cache.tokens(state).tolist() == list(range(10, 20)) + list(range(t + 1))
    kept = cache.tokens(state)
    state.generated_tokens.append(99)
    assert cache.tokens(state)[-1] == 99 and kept.size == 50   # an earlier view stays whole
    state.generated_tokens[-1] = 7           # a changed token is noticed
    assert cache.tokens(state)[-1] == 7
    state.generated_tokens = [1, 2]          # a new list (the engine reset the request)
    assert cache.tokens(state).tolist() == list(range(10, 20)) + [1, 2]
    state.initial_tokens = [4]
    assert cache.tokens(state).tolist() == [4, 1, 2]
