"""One guarded step's requests as arrays, one row per request.

The guard's fixed work per step (what does not grow with the slots it verifies) used to be a
Python loop per request: a numpy array of each block table and of each request's token list,
a slice of the read indices, a read-index comparison, the expected tokens and positions of
its new tokens. With up to a few dozen requests in a step and a small model, that loop cost
more than the engine's own step. :class:`StepBatch` is built once per step and cache group:
the only loop left walks the engine's request objects (their lengths and ids); the block
tables become one ``[requests, positions]`` slot grid (:meth:`BlockTables.grid`), the tokens one flat
array, and everything the plan, the verify and the write need is computed from those with a
few array operations for the whole batch.

A request's token array is kept between steps (:class:`TokenCache`): the engine only appends
generated tokens, so a step converts the new ones, not the whole prompt again.
"""

from __future__ import annotations

from itertools import chain

import numpy as np


class TokenCache:
    """A request's token ids (prompt + generated) as an int64 array, kept between steps:
    each call converts only the tokens appended since the last one. A new prompt list, a new
    generated list, a shorter one, or a last cached token that no longer matches rebuilds it
    from scratch, so the array is always the engine's lists."""

    __slots__ = ("buffer", "initial", "generated", "known_initial", "known_generated",
                 "last_token")

    def __init__(self):
        self.buffer = np.zeros(0, dtype=np.int64)
        self.initial = self.generated = None
        self.known_initial = self.known_generated = 0
        self.last_token = None    # the last generated token converted (a Python int)

    def tokens(self, state) -> np.ndarray:
        initial, generated = state.initial_tokens, state.generated_tokens
        n_init, n_gen = len(initial), len(generated)
        known = self.known_generated
        same = (initial is self.initial and generated is self.generated
                and n_init == self.known_initial and n_gen >= known
                and (known == 0 or generated[known - 1] == self.last_token))
        if not same:
            self.initial, self.generated = initial, generated
            self.known_initial, known = n_init, 0
            self.buffer = np.zeros(max(16, 2 * (n_init + n_gen)), dtype=np.int64)
            self.buffer[:n_init] = initial
        total = n_init + n_gen
        if n_gen > known:
            if total > self.buffer.size:
                grown = np.zeros(2 * total, dtype=np.int64)
                grown[:n_init + known] = self.buffer[:n_init + known]
                self.buffer = grown
            if n_gen == known + 1:    # a decode step's one new token
                self.buffer[total - 1] = generated[known]
            else:
                self.buffer[n_init + known:total] = generated[known:]
            self.last_token = generated[n_gen - 1]
        self.known_generated = n_gen
        return self.buffer[:total]


class RequestRecord:
    """kvcanary's record of one request it follows: ``length`` its count of the request's
    cached tokens, ``serial`` its key in the session's log of own writes (never reused),
    ``uid`` the request's row in the names table behind the writer column (renumbered when
    that table is compacted), ``token_cache`` its token ids."""

    __slots__ = ("request_id", "state", "length", "serial", "uid", "restored", "token_cache")

    def __init__(self, request_id, state, length, serial, uid):
        self.request_id, self.state, self.length = request_id, state, length
        self.serial, self.uid = serial, uid
        self.restored = False
        self.token_cache = TokenCache()


class BlockTables:
    """The block tables of a step's requests as one flat array: request ``i``'s blocks are
    ``flat[start[i]:start[i] + count[i]]`` (a copy, taken when the step is gathered)."""

    __slots__ = ("flat", "count", "start")

    def __init__(self, block_lists):
        self.count = np.fromiter(map(len, block_lists), dtype=np.int64, count=len(block_lists))
        self.flat = np.fromiter(chain.from_iterable(block_lists), dtype=np.int64,
                                count=int(self.count.sum()))
        self.start = self.count.cumsum() - self.count

    def grid(self, block_index: np.ndarray, offset: np.ndarray, page: int,
             missing: int) -> np.ndarray:
        """``int64[requests, len(block_index)]``: per request and position, the slot
        ``blocks[block_index] * page + offset``, ``missing`` where the request has no such
        block. ``block_index`` and ``offset`` give, per position, which of a request's blocks
        holds it and where in the block (the same for every request)."""
        flat = self.flat if self.flat.size else np.zeros(1, dtype=np.int64)
        inside = block_index[None, :] < self.count[:, None]
        index = np.where(inside, self.start[:, None] + block_index[None, :], 0)
        return np.where(inside, flat[index] * page + offset[None, :], missing)

    def lists(self) -> list:
        """Each request's blocks as a list."""
        flat = self.flat.tolist()
        return [flat[start:start + count]
                for start, count in zip(self.start.tolist(), self.count.tolist())]


class StepBatch:
    """The requests of the step being guarded, one row each.

    ``recs``: kvcanary's record of each request; ``query`` the tokens it writes now,
    ``engine_past`` the engine's position offset before the step, ``past`` kvcanary's own
    count of its cached tokens (all int64 ``[n]``); ``table`` the slots the step expects per
    position (``int64[n, width]``, valid below ``reach``); ``read`` the slots verified per
    position (valid below ``past``); ``tokens`` the requests' token ids one after another,
    request ``i``'s from ``token_start[i]``, ``token_len[i]`` of them; ``blocks`` their block
    tables (:class:`BlockTables`) when the step has them."""

    __slots__ = ("recs", "query", "engine_past", "past", "reach", "table", "read", "tokens",
                 "token_start", "token_len", "token_views", "owners", "entry", "blocks")

    def __init__(self, recs, query, engine_past, past, table, token_views, blocks=None):
        self.recs, self.blocks = recs, blocks
        self.query, self.engine_past, self.past = query, engine_past, past
        self.reach = np.maximum(past, engine_past) + query + 1
        self.table = table
        self.read = table
        self.token_views = token_views
        self.token_len = np.fromiter(map(len, token_views), dtype=np.int64,
                                     count=len(token_views))
        self.token_start = self.token_len.cumsum() - self.token_len
        self.tokens = np.concatenate(token_views + [np.zeros(1, dtype=np.int64)])
        # Per token this step writes: its request row and its index among that row's tokens.
        self.owners = np.arange(len(recs)).repeat(query)
        self.entry = np.arange(self.owners.size) - (query.cumsum() - query)[self.owners]

    def __len__(self) -> int:
        return len(self.recs)

    def read_from(self, read_all: np.ndarray, count: np.ndarray, first: np.ndarray,
                  window: int) -> None:
        """Verify the slots the step's read indices ``read_all`` name instead of the table's,
        where they cover a cached position (inside the last ``window`` ones when above 0).
        The engine lists ``count`` indices per request, one request after another, the first
        of them reading position ``first``."""
        offset = count.cumsum() - count
        got = np.minimum(np.maximum(read_all.size - offset, 0), count)
        low = np.maximum(first, self.past - window) if window else first
        high = np.minimum(np.minimum(self.past, self.engine_past), first + got)
        columns = np.arange(self.table.shape[1])
        rows, positions = np.nonzero((columns[None, :] >= low[:, None])
                                     & (columns[None, :] < high[:, None]))
        if rows.size:
            self.read = self.table.copy()
            self.read[rows, positions] = read_all[offset[rows] + positions - first[rows]]

    def table_of(self, i: int) -> np.ndarray:
        """Request ``i``'s expected slots of positions ``[0, reach)``."""
        return self.table[i, :int(self.reach[i])]

    def slots_from(self, start: np.ndarray) -> np.ndarray:
        """Per token this step writes, the table's slot ``entry`` positions after its row's
        ``start`` (``int64[n]``)."""
        return self.table[self.owners, start[self.owners] + self.entry]

    def expected_tokens(self, positions: np.ndarray) -> np.ndarray:
        """Per token this step writes, its request's token at ``positions``; -1 past the
        request's tokens."""
        owners = self.owners
        known = positions < self.token_len[owners]
        index = np.where(known, self.token_start[owners] + positions, 0)
        return np.where(known, self.tokens[index], -1)

    def token_pool(self, width: int) -> tuple:
        """``(pool, valid)``: the plan's expected-token table (``int64[n + 1, width]``, row 0
        padding, -1 past a request's tokens) and each request's count of valid entries."""
        valid = np.minimum(self.token_len, width)
        columns = np.arange(width)
        known = columns[None, :] < valid[:, None]
        index = np.where(known, self.token_start[:, None] + columns[None, :], 0)
        pool = np.full((len(self.recs) + 1, width), -1, dtype=np.int64)
        pool[1:] = np.where(known, self.tokens[index], -1)
        return pool, valid
