"""The scheduler: admission, chunked prefill, decode, finish.

A request is admitted when a request row is free, fewer than ``max_running`` run, and the
allocator can promise the pages it will ever need (evicting cached blocks if it must). It maps
its matched prefix-cache blocks into its row of the slot table (``req_to_token``, or the block
table of a paged engine), then every step extends by up
to ``chunk_size`` prompt tokens (chunked prefill), or by one token once its prompt is in
(decode). Under a sliding window a request's SWA slots are freed once they leave its window. A
request that has written all its tokens finishes: its full blocks go to the prefix cache, its
row and unused reservation come back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .allocator import SlotAllocator
from .config import Stats, SynthConfig
from .kv_pool import KvPool
from .prefix_cache import PrefixCache
from .tables import BlockTable, TokenTable
from .workload import Workload


@dataclass(eq=False)
class Request:
    index: int
    row: int
    tokens: np.ndarray
    prompt_len: int
    matched: int
    blocks: list
    pages: list = field(default_factory=list)
    seq_len: int = 0
    swa_freed: int = 0
    reserved: int = 0

    @property
    def total_len(self) -> int:
        return int(self.tokens.shape[0])


class Scheduler:
    def __init__(self, config: SynthConfig, allocator: SlotAllocator, cache: PrefixCache,
                 workload: Workload, pool: KvPool, stats: Stats):
        self.config = c = config
        self.allocator, self.cache, self.workload, self.pool = allocator, cache, workload, pool
        self.stats = stats
        self.rows = c.max_running + 1       # row 0 is never handed out
        self.table = (BlockTable(self.rows, c.max_context_len, c.block_size) if c.paged
                      else TokenTable(self.rows, c.max_context_len))
        self.token_pool = np.zeros((self.rows, c.max_context_len), dtype=np.int32)
        self.free_rows = list(range(self.rows - 1, 0, -1))
        self.running: list = []
        self.admitted = 0
        self.step_index = 0
        self._pending = None    # the next request's tokens, kept while it waits for pages

    @property
    def all_admitted_and_prefilled(self) -> bool:
        return self.admitted >= self.config.requests and all(
            r.seq_len >= r.prompt_len for r in self.running)

    # ------------------------------------------------------------------ admission

    def admit(self) -> bool:
        """Admit the next request if a row and its pages are available."""
        c, allocator = self.config, self.allocator
        if self.admitted >= c.requests or not self.free_rows:
            return False
        if len(self.running) >= c.max_running:
            return False
        if self._pending is None:
            self._pending = self.workload.next_request()
        prompt, output = self._pending
        blocks = self.cache.match(prompt, prompt.shape[0] - 1)
        matched = len(blocks) * c.block_tokens
        total = prompt.shape[0] + output.shape[0]
        need = allocator.pages_for(matched, total - matched)
        if allocator.unreserved_pages < need:
            for block in blocks:
                block.refs += 1  # keep the match while evicting
            ok = self.cache.evict(need)
            for block in blocks:
                block.refs -= 1
            if not ok:
                return False
        self._pending = None
        row = self.free_rows.pop()
        tokens = np.concatenate([prompt, output])
        request = Request(index=self.admitted, row=row, tokens=tokens,
                          prompt_len=int(prompt.shape[0]), matched=matched, blocks=blocks,
                          seq_len=matched, swa_freed=matched)
        self.cache.acquire(blocks, self.step_index)
        if blocks:
            self.table.map(row, 0, np.concatenate([b.slots for b in blocks]))
        self.token_pool[row, :tokens.shape[0]] = tokens
        allocator.reserve(need)
        request.reserved = need
        self.stats.cached_tokens_reused += matched
        self.running.append(request)
        self.admitted += 1
        return True

    def _allocate(self, request: Request, count: int) -> np.ndarray:
        """Full slots for the request's next ``count`` positions (new pages as needed)."""
        ps = self.allocator.page_size
        first = request.seq_len
        new_pages = self.allocator.pages_for(first, count)
        if new_pages:
            request.pages.extend(self.allocator.take_reserved_pages(new_pages).tolist())
            request.reserved -= new_pages
        positions = np.arange(first, first + count, dtype=np.int64)
        page_index = positions // ps - request.matched // ps
        pages = np.asarray(request.pages, dtype=np.int64)[page_index]
        return pages * ps + positions % ps

    # ------------------------------------------------------------------ one step

    def step(self) -> None:
        """Extend every running request (a prefill chunk or one decode token), write, and
        finish the requests that are done."""
        c = self.config
        batch = list(self.running)
        extends = [min(c.chunk_size, r.prompt_len - r.seq_len) if r.seq_len < r.prompt_len
                   else 1 for r in batch]
        full_slots, tokens, positions = [], [], []
        for request, extend in zip(batch, extends):
            slots = self._allocate(request, extend)
            self.table.map(request.row, request.seq_len, slots)
            full_slots.append(slots)
            tokens.append(request.tokens[request.seq_len:request.seq_len + extend])
            positions.append(np.arange(request.seq_len, request.seq_len + extend, dtype=np.int64))
        full_slots = np.concatenate(full_slots)
        tokens = np.concatenate(tokens).astype(np.int64)
        positions = np.concatenate(positions)
        if self.allocator.lut is not None:
            out_loc = self.allocator.take_swa(full_slots)
        else:
            out_loc = full_slots

        self.pool.forward(
            rows=np.array([r.row for r in batch], dtype=np.int64),
            prefix=np.array([r.seq_len for r in batch], dtype=np.int64),
            extend=np.array(extends, dtype=np.int64), tokens=tokens, positions=positions,
            out_loc=out_loc, table=self.table.plan_keywords(),
            expected_tokens=self.token_pool, lut=self.allocator.lut,
            verify_now=c.verify_every > 0 and self.step_index % c.verify_every == 0,
            step=self.step_index, stats=self.stats)
        self.stats.steps += 1
        self.stats.tokens_written += int(tokens.shape[0])
        self.step_index += 1

        still = []
        for request, count in zip(batch, extends):
            request.seq_len += count
            if c.swa_window > 0:
                out_of_window = request.seq_len - c.swa_window
                if out_of_window > request.swa_freed:
                    self.allocator.free_swa_of(
                        self.table.slots(request.row, request.swa_freed, out_of_window))
                    request.swa_freed = out_of_window
            if request.seq_len >= request.total_len:
                self.finish(request)
            else:
                still.append(request)
        self.running = still

    def finish(self, request: Request) -> None:
        """Hand the request's blocks to the prefix cache, free the rest, return its row."""
        row_slots = self.table.slots(request.row, 0, request.seq_len)
        self.cache.insert(request.tokens, request.seq_len, request.blocks, row_slots,
                          self.step_index)
        self.allocator.release(request.reserved)
        self.free_rows.append(request.row)
        self.workload.conversation_finished(request.tokens)
