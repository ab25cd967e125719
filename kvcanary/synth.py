"""A small but honest serving simulation that produces canary dumps, and fault injection.

The simulation is a scheduler loop over requests:

* a slot allocator over pages of ``page_size`` slots that never hands out page 0 (slot 0 is
  the padding slot), frees the slots of finished requests and reuses them (LIFO, so reuse is
  frequent);
* a radix-style prefix cache at block granularity (a block is one page, or 16 tokens when
  ``page_size == 1``): a block's key is its parent block and its tokens, so a lookup walks the
  longest cached prefix of a prompt. A new request maps the matched positions to the cached
  slots and writes only its suffix. Finished requests insert their full blocks (a block that is
  already cached is folded: the request's copy is freed); unreferenced leaf blocks are evicted
  least recently used when the allocator runs short;
* chunked prefill, then one decode token per step;
* optionally a sliding window: the canary group is the SWA pool, indexed by SWA slots through
  ``full_to_swa_index_mapping``; a request's own SWA slots are freed once they leave its window;
* 0..N real-KV sources with ``bytes_per_token`` bytes per slot.

Every step writes the real KV bytes of its new tokens (deterministic per token, position and
source), then runs ``kvcanary.plan`` and ``kvcanary.write`` (TAIL semantics) and, every
``verify_every`` steps, ``kvcanary.verify``; a violation in this honest run is a bug and
raises. The state lives in numpy arrays; ``backend="cupy"`` runs every launch on the CUDA
kernels (the library moves the arrays per launch, so keep such runs small). The run stops once every request was admitted and has finished its prefill; the
requests still running are the dump's live requests, the cache's blocks its sweep entries.

Faults (:data:`FAULT_KINDS`) are injected afterwards into the final state, each at a request's
own entry (not shared with other requests or the cache), with ground truth under ``synth_``
keys.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import api
from .consts import (
    CANARY_SLOT_BYTES,
    REAL_KV_PARTIAL_READ_BYTES,
    FailReason,
    LaunchTag,
    RealKvHashMode,
)
from .hashing import splitmix64_inplace, splitmix64_mix3
from .types import CanaryContext, RealKvSource, VerifyPlan, ViolationLog, WritePlan

# Seeds are recorded in int64 dump keys (synth_config) and feed numpy's SeedSequence.
MAX_SEED = (1 << 63) - 1
FAULT_KINDS = ("token", "position", "prev-hash", "real-kv-byte", "alias", "swap",
               "stale-reuse", "slot-zero", "lost-write")
FAULT_DESCRIPTIONS = {
    "token": "the stored token of a record changed",
    "position": "the stored position of a record changed",
    "prev-hash": "the stored chain link of a record changed",
    "real-kv-byte": "one byte of a slot's real KV changed",
    "alias": "a request's table entry points at another request's slot",
    "swap": "two table entries of one request exchanged",
    "stale-reuse": "a slot reallocated and rewritten while a live request still maps it",
    "slot-zero": "a live table entry mapped to padding slot 0",
    "lost-write": "a token's canary record and KV never written",
}
# Bits that must be present at the fault's target entry for it to count as detected.
EXPECTED_BITS = {
    "token": FailReason.VERIFY_TOKEN_MISMATCH,
    "position": FailReason.VERIFY_POSITION_MISMATCH,
    "prev-hash": FailReason.VERIFY_CHAIN_HASH_MISMATCH,
    "real-kv-byte": FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
    "alias": FailReason.VERIFY_POSITION_MISMATCH,
    "swap": FailReason.VERIFY_POSITION_MISMATCH,
    "stale-reuse": FailReason.VERIFY_POSITION_MISMATCH,
    "slot-zero": FailReason.SLOT_ZERO_IN_PREFIX,
    "lost-write": FailReason.VERIFY_POSITION_MISMATCH | FailReason.VERIFY_CHAIN_HASH_MISMATCH,
}
MODES = ("none", "partial", "all")
SOURCE_DTYPES = (np.uint8, np.float16, np.int32, np.float32)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class SynthError(ValueError):
    """A bad synthesis option, or an honest run that produced a violation (a bug)."""


@dataclass
class SynthConfig:
    requests: int = 64
    num_slots: int = 4096
    max_running: int = 16
    page_size: int = 1
    swa_window: int = 0
    sources: int = 1
    bytes_per_token: int = 32
    mode: str = "all"
    chunk_size: int = 64
    prompt_len: tuple = (8, 96)
    output_len: tuple = (4, 32)
    shared_prefixes: int = 4
    shared_prefix_len: tuple = (16, 64)
    share_prob: float = 0.6
    followup_prob: float = 0.3
    vocab: int = 32000
    verify_every: int = 8
    seed: int = 0
    backend: str = "numpy"

    def validate(self) -> None:
        def need(ok, message):
            if not ok:
                raise SynthError(message)

        need(self.requests >= 1, f"--requests must be at least 1, got {self.requests}")
        need(self.max_running >= 1, f"--max-running must be at least 1, got {self.max_running}")
        need(self.page_size >= 1, f"--page-size must be at least 1, got {self.page_size}")
        need(self.swa_window >= 0, f"--swa-window must be >= 0, got {self.swa_window}")
        need(0 <= self.sources <= 64, f"--sources must be in [0, 64], got {self.sources}")
        need(self.bytes_per_token >= 16 and self.bytes_per_token % 16 == 0,
             f"--bytes-per-token must be a positive multiple of 16, got {self.bytes_per_token}")
        need(self.mode in MODES, f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        need(self.chunk_size >= 1, f"--chunk-size must be at least 1, got {self.chunk_size}")
        need(self.verify_every >= 0, f"--verify-every must be >= 0, got {self.verify_every}")
        need(0 <= self.seed <= MAX_SEED, f"--seed must be in [0, {MAX_SEED}], got {self.seed}")
        for name in ("prompt_len", "output_len", "shared_prefix_len"):
            low, high = getattr(self, name)
            need(1 <= low <= high, f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got "
                                   f"{low}..{high}")
        need(self.backend in ("numpy", "cupy"),
             f"--backend must be numpy or cupy, got {self.backend!r}")
        need(self.vocab >= 2, f"--vocab must be at least 2, got {self.vocab}")
        need(self.num_slots >= 2 * self.page_size,
             f"--slots must hold at least two pages, got {self.num_slots}")
        need(self.num_slots < 2 ** 31, f"--slots must be below 2**31 (int32 table), got "
                                       f"{self.num_slots}")
        least = self.max_context_len + 2 * self.page_size + self.block_tokens
        need(self.num_slots >= least,
             f"--slots {self.num_slots} cannot hold one request of up to {self.max_context_len} "
             f"tokens; use at least {least}")

    @property
    def block_tokens(self) -> int:
        return self.page_size if self.page_size > 1 else 16

    @property
    def single_len(self) -> int:
        return self.shared_prefix_len[1] + self.prompt_len[1] + self.output_len[1]

    @property
    def max_context_len(self) -> int:
        """A follow-up request extends one earlier conversation once."""
        return 2 * self.single_len

    @property
    def hash_mode(self) -> RealKvHashMode:
        return RealKvHashMode[self.mode.upper()]


@dataclass(eq=False)
class _Block:
    key: tuple
    id: int
    parent: "_Block | None"
    depth: int
    slots: np.ndarray
    refs: int = 0
    children: int = 0
    last_used: int = 0


@dataclass(eq=False)
class _Request:
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


@dataclass
class Fault:
    kind: str
    batch_index: int
    request_row: int
    position: int
    slot: int
    expected_bits: int
    visible: bool
    detail: int = -1
    note: str = ""


@dataclass
class Stats:
    steps: int = 0
    tokens_written: int = 0
    cached_tokens_reused: int = 0
    blocks_folded: int = 0
    blocks_evicted: int = 0
    slots_reused: int = 0
    verify_launches: int = 0
    entries_verified: int = 0
    elapsed_s: float = 0.0


class Synthesis:
    """The simulation state; ``run()`` plays the workload, ``inject()`` adds faults,
    ``arrays()`` gives the dump keys."""

    def __init__(self, config: SynthConfig):
        config.validate()
        self.config = c = config
        self.rng = np.random.default_rng(c.seed)
        self.ps = c.page_size
        self.swa = c.swa_window > 0
        num_pages = c.num_slots // self.ps
        self.num_full_slots = num_pages * self.ps
        # Free stacks (LIFO): full-pool pages (page 0 holds padding slot 0) and SWA slots.
        self.free_pages = np.arange(num_pages - 1, 0, -1, dtype=np.int64)
        self.free_pages_top = num_pages - 1
        self.reserved_pages = 0
        if self.swa:
            self.lut = np.zeros(self.num_full_slots, dtype=np.int64)
            self.free_swa = np.arange(self.num_full_slots - 1, 0, -1, dtype=np.int64)
            self.free_swa_top = self.num_full_slots - 1
            self.num_canary_slots = self.num_full_slots
        else:
            self.lut = None
            self.num_canary_slots = self.num_full_slots
        self.canary = np.zeros((self.num_canary_slots, CANARY_SLOT_BYTES), dtype=np.uint8)
        self.write_count = np.zeros(self.num_canary_slots, dtype=np.uint32)
        self.sources = []
        rows = -(-self.num_canary_slots // self.ps)
        for i in range(c.sources):
            dtype = np.dtype(SOURCE_DTYPES[i % len(SOURCE_DTYPES)])
            width = self.ps * c.bytes_per_token // dtype.itemsize
            self.sources.append(np.zeros((rows, width), dtype=dtype))
        self.rows = c.max_running + 1
        self.table = np.zeros((self.rows, c.max_context_len), dtype=np.int32)
        self.token_pool = np.zeros((self.rows, c.max_context_len), dtype=np.int32)
        self.free_rows = list(range(self.rows - 1, 0, -1))
        self.cache: dict = {}
        self.next_block_id = 1
        self.step = 0
        self.running: list = []
        self.finished_sequences: list = []
        self.admitted = 0
        self.stats = Stats()
        self.faults: list = []
        self.tag = LaunchTag.TAIL_K_SWA if self.swa else LaunchTag.TAIL_K_FULL
        self.context = CanaryContext(
            self.canary, kernel_kind=self.tag, violation_log=ViolationLog.allocate(1024),
            slot_run_counter=np.zeros(1, dtype=np.int64),
            kernel_run_counter=np.zeros(1, dtype=np.int64),
            real_kv_sources=tuple(self._source(t) for t in self.sources),
            real_kv_hash_mode=c.hash_mode, max_real_kv_sources=max(4, c.sources))
        self.write_plan = WritePlan.allocate(c.max_running)
        self.system_prompts = [
            self._tokens(int(self.rng.integers(c.shared_prefix_len[0], c.shared_prefix_len[1] + 1)))
            for _ in range(c.shared_prefixes)]

    # ------------------------------------------------------------------ helpers

    def _source(self, tensor) -> RealKvSource:
        return RealKvSource(tensor, page_size=self.ps,
                            num_bytes_per_token=self.config.bytes_per_token,
                            read_bytes=self.config.bytes_per_token)

    def _tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(1, self.config.vocab, size=n, dtype=np.int64).astype(np.int32)

    def canary_slots(self, full_slots: np.ndarray) -> np.ndarray:
        return full_slots if self.lut is None else self.lut[full_slots]

    @property
    def free_page_count(self) -> int:
        return self.free_pages_top

    def _pop_pages(self, n: int) -> np.ndarray:
        if n > self.free_pages_top:
            raise SynthError("internal: the allocator ran out of pages despite reservations")
        top = self.free_pages_top
        pages = self.free_pages[top - n:top][::-1].copy()
        self.free_pages_top -= n
        return pages

    def _push_pages(self, pages: np.ndarray) -> None:
        n = int(pages.shape[0])
        if n:
            top = self.free_pages_top
            self.free_pages[top:top + n] = pages
            self.free_pages_top += n

    def _pop_swa(self, n: int) -> np.ndarray:
        top = self.free_swa_top
        slots = self.free_swa[top - n:top][::-1].copy()
        self.free_swa_top -= n
        return slots

    def _free_full_slots(self, slots: np.ndarray) -> None:
        """Free page-aligned groups of full slots (and their resident SWA slots)."""
        if slots.size == 0:
            return
        if self.swa:
            self._free_swa_of(slots)
        self._push_pages(np.unique(slots // self.ps))

    def _free_swa_of(self, full_slots: np.ndarray) -> None:
        swa = self.lut[full_slots]
        resident = swa != 0
        n = int(resident.sum())
        if n:
            top = self.free_swa_top
            self.free_swa[top:top + n] = swa[resident]
            self.free_swa_top += n
            self.lut[full_slots[resident]] = 0

    def _kv_bytes(self, tokens: np.ndarray, positions: np.ndarray, source: int) -> np.ndarray:
        """``uint8 [n, bytes_per_token]``: the deterministic KV bytes of each token."""
        words = self.config.bytes_per_token // 8
        base = splitmix64_mix3(tokens.astype(np.int64), positions.astype(np.int64),
                               np.full(tokens.shape, source + 1, dtype=np.int64))
        out = base[:, None] ^ (np.arange(1, words + 1, dtype=np.uint64) * _GOLDEN)[None, :]
        splitmix64_inplace(out.reshape(-1))
        return out.view(np.uint8).reshape(tokens.shape[0], self.config.bytes_per_token)

    def _write_kv(self, canary_slots, tokens, positions) -> None:
        bpt = self.config.bytes_per_token
        for index, tensor in enumerate(self.sources):
            view = tensor.view(np.uint8).reshape(tensor.shape[0], self.ps, bpt)
            view[canary_slots // self.ps, canary_slots % self.ps] = self._kv_bytes(
                tokens, positions, index)

    # ------------------------------------------------------------------ prefix cache

    def _match(self, tokens: np.ndarray, limit: int) -> list:
        """Cached blocks covering the longest prefix of ``tokens[:limit]``."""
        B, blocks, parent = self.config.block_tokens, [], 0
        for k in range(limit // B):
            block = self.cache.get((parent, tokens[k * B:(k + 1) * B].tobytes()))
            if block is None:
                break
            blocks.append(block)
            parent = block.id
        if self.swa and blocks:
            # Only a prefix whose last window is still SWA-resident can be reused.
            W = self.config.swa_window
            while blocks:
                slots = np.concatenate([b.slots for b in blocks])
                if (self.lut[slots[max(0, slots.size - W):]] != 0).all():
                    break
                blocks.pop()
        return blocks

    def _insert(self, request: _Request) -> None:
        """Cache the request's full blocks; free everything else it owns."""
        B = self.config.block_tokens
        row_slots = self.table[request.row, :request.seq_len].astype(np.int64)
        parent = request.blocks[-1] if request.blocks else None
        for block in request.blocks:
            block.refs -= 1
            block.last_used = self.step
        first = len(request.blocks)
        full = request.seq_len // B
        for k in range(first, full):
            key = (parent.id if parent else 0,
                   request.tokens[k * B:(k + 1) * B].tobytes())
            slots = row_slots[k * B:(k + 1) * B]
            block = self.cache.get(key)
            if block is None:
                block = _Block(key=key, id=self.next_block_id, parent=parent, depth=k,
                               slots=slots.copy(), last_used=self.step)
                self.next_block_id += 1
                self.cache[key] = block
                if parent is not None:
                    parent.children += 1
            else:
                self._free_full_slots(slots)
                self.stats.blocks_folded += 1
                block.last_used = self.step
            parent = block
        self._free_full_slots(row_slots[full * B:request.seq_len])

    def _evict(self, pages_needed: int) -> bool:
        """Evict unreferenced leaf blocks, least recently used first, until the free pages
        cover ``pages_needed`` plus a small reserve."""
        reserve = max(1, (self.num_full_slots // self.ps) // 32)
        target = pages_needed + reserve
        while self.free_pages_top - self.reserved_pages < target:
            leaves = [b for b in self.cache.values() if b.refs == 0 and b.children == 0]
            if not leaves:
                return self.free_pages_top - self.reserved_pages >= pages_needed
            leaves.sort(key=lambda b: (b.last_used, b.id))
            for block in leaves:
                del self.cache[block.key]
                if block.parent is not None:
                    block.parent.children -= 1
                self._free_full_slots(block.slots)
                self.stats.blocks_evicted += 1
                if self.free_pages_top - self.reserved_pages >= target:
                    break
        return True

    # ------------------------------------------------------------------ requests

    def _new_request_tokens(self) -> np.ndarray:
        c = self.config
        prompt = self._tokens(int(self.rng.integers(c.prompt_len[0], c.prompt_len[1] + 1)))
        output = self._tokens(int(self.rng.integers(c.output_len[0], c.output_len[1] + 1)))
        roll = self.rng.random()
        if roll < c.followup_prob and self.finished_sequences:
            parent = self.finished_sequences[int(self.rng.integers(len(self.finished_sequences)))]
            if parent.shape[0] + prompt.shape[0] + output.shape[0] <= c.max_context_len:
                return np.concatenate([parent, prompt]), output
        if roll < c.followup_prob + c.share_prob and self.system_prompts:
            system = self.system_prompts[int(self.rng.integers(len(self.system_prompts)))]
            return np.concatenate([system, prompt]), output
        return prompt, output

    def _pages_for(self, first: int, count: int) -> int:
        """New pages a request needs to write positions ``[first, first + count)``."""
        if count <= 0:
            return 0
        return (first + count - 1) // self.ps - (first - 1) // self.ps if first > 0 else \
            (count - 1) // self.ps + 1

    def _admit(self) -> bool:
        if self.admitted >= self.config.requests or not self.free_rows:
            return False
        if len(self.running) >= self.config.max_running:
            return False
        if not hasattr(self, "_pending"):
            self._pending = None
        if self._pending is None:
            self._pending = self._new_request_tokens()
        prompt, output = self._pending
        blocks = self._match(prompt, prompt.shape[0] - 1)
        matched = len(blocks) * self.config.block_tokens
        total = prompt.shape[0] + output.shape[0]
        need = self._pages_for(matched, total - matched)
        if self.free_pages_top - self.reserved_pages < need:
            for block in blocks:
                block.refs += 1  # keep the match while evicting
            ok = self._evict(need)
            for block in blocks:
                block.refs -= 1
            if not ok:
                return False
        self._pending = None
        row = self.free_rows.pop()
        tokens = np.concatenate([prompt, output])
        request = _Request(index=self.admitted, row=row, tokens=tokens,
                           prompt_len=int(prompt.shape[0]), matched=matched, blocks=blocks,
                           seq_len=matched, swa_freed=matched)
        for block in blocks:
            block.refs += 1
            block.last_used = self.step
        if blocks:
            self.table[row, :matched] = np.concatenate([b.slots for b in blocks])
        self.token_pool[row, :tokens.shape[0]] = tokens
        self.reserved_pages += need
        request.reserved = need
        self.stats.cached_tokens_reused += matched
        self.running.append(request)
        self.admitted += 1
        return True

    def _allocate(self, request: _Request, count: int) -> np.ndarray:
        first = request.seq_len
        new_pages = self._pages_for(first, count)
        if new_pages:
            request.pages.extend(self._pop_pages(new_pages).tolist())
            self.reserved_pages -= new_pages
            request.reserved -= new_pages
        positions = np.arange(first, first + count, dtype=np.int64)
        page_index = positions // self.ps - request.matched // self.ps
        pages = np.asarray(request.pages, dtype=np.int64)[page_index]
        return pages * self.ps + positions % self.ps

    # ------------------------------------------------------------------ the loop

    def run(self, progress=None) -> "Synthesis":
        started = time.perf_counter()
        c = self.config
        while True:
            while self._admit():
                pass
            if not self.running:
                raise SynthError("internal: nothing is running and nothing can be admitted")
            self._step()
            if progress:   # the run ends when every request is admitted and prefilled
                progress(self.admitted - sum(r.seq_len < r.prompt_len for r in self.running),
                         c.requests)
            if self.admitted >= c.requests and all(r.seq_len >= r.prompt_len for r in self.running):
                break
        self.stats.elapsed_s = time.perf_counter() - started
        return self

    def _step(self) -> None:
        c = self.config
        batch, extends = [], []
        for request in self.running:
            if request.seq_len < request.prompt_len:
                extend = min(c.chunk_size, request.prompt_len - request.seq_len)
            else:
                extend = 1
            batch.append(request)
            extends.append(extend)
        full_slots, tokens, positions = [], [], []
        for request, extend in zip(batch, extends):
            slots = self._allocate(request, extend)
            self.table[request.row, request.seq_len:request.seq_len + extend] = slots
            full_slots.append(slots)
            tokens.append(request.tokens[request.seq_len:request.seq_len + extend])
            positions.append(np.arange(request.seq_len, request.seq_len + extend, dtype=np.int64))
        full_slots = np.concatenate(full_slots)
        tokens = np.concatenate(tokens).astype(np.int64)
        positions = np.concatenate(positions)
        if self.swa:
            swa = self._pop_swa(full_slots.shape[0])
            self.lut[full_slots] = swa
            out_loc = swa
        else:
            out_loc = full_slots
        reused = self.write_count[out_loc] > 0
        self.stats.slots_reused += int(reused.sum())
        self.write_count[out_loc] += 1
        self._write_kv(out_loc, tokens, positions)  # the forward writes the real KV first

        rows = np.array([r.row for r in batch], dtype=np.int64)
        prefix = np.array([r.seq_len for r in batch], dtype=np.int64)
        extend = np.array(extends, dtype=np.int64)
        verify_now = c.verify_every > 0 and self.step % c.verify_every == 0
        if verify_now:
            starts = np.maximum(0, prefix - c.swa_window) if self.swa else np.zeros_like(prefix)
            capacity = max(1, int((prefix - starts).sum()))
        else:
            capacity = 1
        verify_plan = VerifyPlan.allocate(capacity)
        backend = c.backend
        api.plan(req_pool_indices=rows, prefix_lens=prefix, extend_seq_lens=extend,
                 req_to_token=self.table, verify_plan=verify_plan, write_plan=self.write_plan,
                 swa_window_size=c.swa_window, full_to_swa_index_mapping=self.lut,
                 req_to_verify_expected_tokens=self.token_pool,
                 req_to_verify_expected_tokens_valid_lens=prefix.copy(), backend=backend)
        log = self.context.violation_log
        if verify_now:
            api.verify(self.context, verify_plan, check_expected_token=True, backend=backend)
            self.stats.verify_launches += 1
            self.stats.entries_verified += int(verify_plan.verify_num_valid[0])
        api.write(self.context, self.write_plan, input_ids=tokens, positions=positions,
                  out_cache_loc=out_loc, backend=backend)
        if log.total:
            raise SynthError("internal: the honest simulation produced canary violations "
                             f"at step {self.step}:\n" + "\n".join(
                                 v.log_line() for v in log.violations()[:5]))
        self.stats.steps += 1
        self.stats.tokens_written += int(tokens.shape[0])
        self.step += 1

        still = []
        for request, count in zip(batch, extends):
            request.seq_len += count
            if self.swa:
                out_of_window = request.seq_len - c.swa_window
                if out_of_window > request.swa_freed:
                    self._free_swa_of(self.table[request.row, request.swa_freed:out_of_window]
                                      .astype(np.int64))
                    request.swa_freed = out_of_window
            if request.seq_len >= request.total_len:
                self._finish(request)
            else:
                still.append(request)
        self.running = still

    def _finish(self, request: _Request) -> None:
        self._insert(request)
        self.reserved_pages -= request.reserved
        self.free_rows.append(request.row)
        self.finished_sequences.append(request.tokens.copy())
        if len(self.finished_sequences) > 64:
            self.finished_sequences.pop(0)

    # ------------------------------------------------------------------ the dump

    def sweep_entries(self):
        slots, prevs, positions = [], [], []
        B = self.config.block_tokens
        for block in self.cache.values():
            own = block.slots.astype(np.int64)
            prev = np.empty_like(own)
            prev[0] = block.parent.slots[-1] if block.parent is not None else -1
            prev[1:] = own[:-1]
            slots.append(own)
            prevs.append(prev)
            positions.append(block.depth * B + np.arange(B, dtype=np.int64))
        if not slots:
            return None
        slots, prevs = np.concatenate(slots), np.concatenate(prevs)
        if self.swa:
            slots = self.lut[slots]
            prevs = np.where(prevs >= 0, self.lut[np.maximum(prevs, 0)], prevs)
        return slots, prevs, np.concatenate(positions)

    def live(self):
        rows = np.array([r.row for r in self.running], dtype=np.int64)
        seq_lens = np.array([r.seq_len for r in self.running], dtype=np.int64)
        return rows, seq_lens

    def arrays(self) -> dict:
        c = self.config
        rows, seq_lens = self.live()
        out = {
            "canary": self.canary,
            "req_to_token": self.table,
            "req_pool_indices": rows,
            "seq_lens": seq_lens,
            "launch_tag": self.tag.name,
            "expected_tokens": self.token_pool,
            "expected_tokens_valid_lens": seq_lens.copy(),
        }
        if self.sources:
            for index, tensor in enumerate(self.sources):
                out[f"real_kv_{index}"] = tensor
            out["real_kv_params"] = np.array(
                [[self.ps, c.bytes_per_token, c.bytes_per_token]] * len(self.sources),
                dtype=np.int64)
            out["real_kv_hash_mode"] = c.mode
        if self.swa:
            out["swa_window_size"] = np.array(c.swa_window, dtype=np.int64)
            out["full_to_swa_index_mapping"] = self.lut
        sweep = self.sweep_entries()
        if sweep is not None:
            out["sweep_slot_indices"], out["sweep_prev_slot_indices"], out["sweep_positions"] = sweep
        out["synth_config"] = json.dumps(asdict(self.config), sort_keys=True)
        out["synth_stats"] = json.dumps(asdict(self.stats), sort_keys=True)
        out["synth_fault_kinds"] = ",".join(FAULT_KINDS)
        f = self.faults
        out["synth_fault_kind"] = np.array([FAULT_KINDS.index(x.kind) for x in f], dtype=np.int64)
        for name in ("batch_index", "request_row", "position", "slot", "expected_bits",
                     "detail"):
            out[f"synth_fault_{name}"] = np.array([getattr(x, name) for x in f], dtype=np.int64)
        out["synth_fault_visible"] = np.array([int(x.visible) for x in f], dtype=np.int64)
        return out

    # ------------------------------------------------------------------ faults

    def inject(self, kind: str, count: int = 1) -> list:
        """Inject ``count`` faults of ``kind`` into the final state; returns them."""
        if kind not in FAULT_KINDS:
            raise SynthError(f"--inject: unknown fault kind {kind!r} (one of "
                             f"{', '.join(FAULT_KINDS)})")
        if count < 1:
            raise SynthError(f"--inject {kind}: COUNT must be at least 1, got {count}")
        if kind == "real-kv-byte" and not self.sources:
            raise SynthError("--inject real-kv-byte needs at least one real-KV source "
                             "(--sources >= 1)")
        made = []
        for _ in range(count):
            fault = getattr(self, "_inject_" + kind.replace("-", "_"))(len(made))
            self.faults.append(fault)
            made.append(fault)
        return made

    def _candidates(self):
        """(batch index, position) of every request-owned live entry whose predecessor and
        successor are inside the verified window (a window head's predecessor may have lost
        its SWA slot, which makes its chain link unreachable)."""
        W = self.config.swa_window
        batch, positions = [], []
        for b, request in enumerate(self.running):
            low = max(request.matched, 1, request.seq_len - W + 1 if W else 0)
            high = request.seq_len - 1
            if high > low:
                batch.append(np.full(high - low, b, dtype=np.int64))
                positions.append(np.arange(low, high, dtype=np.int64))
        if not batch:
            raise SynthError("no live request owns enough entries to inject faults into; "
                             "use more requests or longer prompts")
        return np.concatenate(batch), np.concatenate(positions)

    def _used(self) -> set:
        if not hasattr(self, "_used_entries"):
            self._used_entries, self._used_slots = set(), set()
        return self._used_entries

    def _pick(self, extra_filter=None):
        used = self._used()
        batch, positions = self._candidates()
        order = self.rng.permutation(batch.shape[0])
        for i in order.tolist():
            b, p = int(batch[i]), int(positions[i])
            request = self.running[b]
            if any((request.row, q) in used for q in (p - 1, p, p + 1)):
                continue
            slot = int(self.canary_slots(np.array([self.table[request.row, p]], np.int64))[0])
            if slot in self._used_slots or slot == 0:
                continue
            if extra_filter and not extra_filter(b, p, slot):
                continue
            used.add((request.row, p))
            self._used_slots.add(slot)
            return b, p, slot
        raise SynthError("ran out of distinct live entries to inject faults into; use more "
                         "requests or fewer faults")

    def _fault(self, kind, b, p, slot, *, visible=True, detail=-1, note="") -> Fault:
        return Fault(kind=kind, batch_index=b, request_row=self.running[b].row, position=p,
                     slot=slot, expected_bits=int(EXPECTED_BITS[kind]), visible=visible,
                     detail=detail, note=note)

    def _fields(self):
        return self.canary.view("<i8")[:, :4]

    def _inject_token(self, k):
        b, p, slot = self._pick()
        self._fields()[slot, 0] += 1
        return self._fault("token", b, p, slot)

    def _inject_position(self, k):
        b, p, slot = self._pick()
        self._fields()[slot, 1] += 1
        return self._fault("position", b, p, slot)

    def _inject_prev_hash(self, k):
        b, p, slot = self._pick()
        bit = int(self.rng.integers(64))
        self._fields()[slot, 2] ^= np.int64(-(1 << 63)) if bit == 63 else np.int64(1 << bit)
        return self._fault("prev-hash", b, p, slot, detail=bit)

    def _inject_real_kv_byte(self, k):
        c = self.config
        b, p, slot = self._pick()
        source = k % len(self.sources)
        offset = (k * 16 + int(self.rng.integers(16))) % c.bytes_per_token
        view = self.sources[source].view(np.uint8).reshape(-1, self.ps, c.bytes_per_token)
        view[slot // self.ps, slot % self.ps, offset] ^= np.uint8(1 << int(self.rng.integers(8)))
        mode = c.hash_mode
        visible = mode == RealKvHashMode.ALL or (
            mode == RealKvHashMode.PARTIAL and offset < REAL_KV_PARTIAL_READ_BYTES)
        if mode == RealKvHashMode.NONE:
            note = "not visible in none mode (real KV is not hashed)"
        elif not visible:
            note = (f"not visible in partial mode (byte {offset} is outside the "
                    f"{REAL_KV_PARTIAL_READ_BYTES} bytes partial hashes)")
        else:
            note = f"byte {offset} of source {source}"
        return self._fault("real-kv-byte", b, p, slot, visible=visible, detail=offset, note=note)

    def _inject_alias(self, k):
        b, p, slot = self._pick()
        request = self.running[b]
        batch, positions = self._candidates()
        for i in self.rng.permutation(batch.shape[0]).tolist():
            b2, p2 = int(batch[i]), int(positions[i])
            other = self.running[b2]
            if b2 == b or p2 == p:
                continue
            full = int(self.table[other.row, p2])
            target = int(self.canary_slots(np.array([full], np.int64))[0])
            if target == 0 or target in self._used_slots or (other.row, p2) in self._used():
                continue
            self._used_slots.add(target)
            self._used().add((other.row, p2))
            self.table[request.row, p] = full
            return self._fault("alias", b, p, slot, detail=target,
                               note=f"now maps slot {target} (request row {other.row}, "
                                    f"position {p2})")
        raise SynthError("alias needs a second live request with an owned entry")

    def _inject_swap(self, k):
        b, p, slot = self._pick()
        request = self.running[b]
        b2, p2, slot2 = self._pick(lambda bb, pp, ss: bb == b and abs(pp - p) > 1)
        row = request.row
        self.table[row, p], self.table[row, p2] = self.table[row, p2], self.table[row, p]
        return self._fault("swap", b, p, slot, detail=p2, note=f"exchanged with position {p2}")

    def _inject_stale_reuse(self, k):
        b, p, slot = self._pick()
        new_position = p + 1 + int(self.rng.integers(1, 64))
        token = self._tokens(1).astype(np.int64)
        positions = np.array([new_position], dtype=np.int64)
        slots = np.array([slot], dtype=np.int64)
        self._write_kv(slots, token, positions)
        plan = WritePlan(write_offsets=np.array([0, 1], dtype=np.int64),
                         write_seed_slot_indices=np.array([-1], dtype=np.int64),
                         write_num_valid_reqs=np.array([1], dtype=np.int32))
        api.write(self.context, plan, input_ids=token, positions=positions, out_cache_loc=slots,
                  backend=self.config.backend)
        self.write_count[slot] += 1
        return self._fault("stale-reuse", b, p, slot, detail=new_position,
                           note=f"rewritten as position {new_position} of another sequence")

    def _inject_slot_zero(self, k):
        b, p, slot = self._pick()
        self.table[self.running[b].row, p] = 0
        return self._fault("slot-zero", b, p, slot,
                           note="seen only by kvcanary's SLOT_ZERO_IN_PREFIX extension")

    def _inject_lost_write(self, k):
        fresh = self.write_count == 1
        try:
            b, p, slot = self._pick(lambda bb, pp, ss: bool(fresh[ss]))
            note = "slot never written (first occupant)"
        except SynthError:
            b, p, slot = self._pick()
            note = "slot had an earlier occupant; left zeroed"
        self.canary[slot] = 0
        bpt = self.config.bytes_per_token
        for tensor in self.sources:
            tensor.view(np.uint8).reshape(-1, self.ps, bpt)[slot // self.ps, slot % self.ps] = 0
        return self._fault("lost-write", b, p, slot, note=note)


def inapplicable_kinds(config: "SynthConfig") -> dict:
    """Fault kinds that cannot be injected into a workload of ``config``, with the reason."""
    if config.sources == 0:
        return {"real-kv-byte": "no real-KV sources (--sources 0)"}
    return {}


def parse_inject(specs, config: "SynthConfig | None" = None) -> list:
    """``["token", "alias:3"]`` -> ``[("token", 1), ("alias", 3)]``; ``all`` means every
    kind that applies to ``config`` (see :func:`inapplicable_kinds`)."""
    skipped = inapplicable_kinds(config) if config is not None else {}
    result = []
    for spec in specs:
        kind, _, count = spec.partition(":")
        kind = kind.strip()
        try:
            number = int(count) if count else 1
        except ValueError:
            raise SynthError(f"--inject {spec}: COUNT must be an integer") from None
        kinds = [k for k in FAULT_KINDS if k not in skipped] if kind == "all" else (kind,)
        for name in kinds:
            if name not in FAULT_KINDS:
                raise SynthError(f"--inject: unknown fault kind {name!r} (one of "
                                 f"{', '.join(FAULT_KINDS)}, or all)")
            if number < 1:
                raise SynthError(f"--inject {spec}: COUNT must be at least 1")
            result.append((name, number))
    return result


def synthesize(config: SynthConfig, inject=(), progress=None) -> Synthesis:
    """Run the simulation, then inject ``[(kind, count), ...]``."""
    synthesis = Synthesis(config).run(progress=progress)
    for kind, count in inject:
        synthesis.inject(kind, count)
    return synthesis


# ---------------------------------------------------------------------- ground truth


@dataclass
class FaultOutcome:
    kind: str
    request_row: int
    position: int
    slot: int
    expected_bits: int
    visible: bool
    detected: bool
    fired_bits: int
    note: str = ""


def faults_from_dump(dump) -> list:
    """The ground truth a synth dump carries, as :class:`Fault` rows."""
    extra = dump.extra
    if "synth_fault_kind" not in extra:
        return []
    names = str(extra.get("synth_fault_kinds", ",".join(FAULT_KINDS))).split(",")
    get = lambda key: np.asarray(extra[f"synth_fault_{key}"]).astype(np.int64).tolist()  # noqa: E731
    return [Fault(kind=names[k], batch_index=b, request_row=r, position=p, slot=s,
                  expected_bits=e, visible=bool(v), detail=d)
            for k, b, r, p, s, e, v, d in zip(get("kind"), get("batch_index"), get("request_row"),
                                              get("position"), get("slot"), get("expected_bits"),
                                              get("visible"), get("detail"))]


def fault_note(fault: Fault, mode: RealKvHashMode, compat: bool = False) -> str:
    """Why a fault is or is not visible, in words."""
    if fault.kind == "real-kv-byte":
        if mode == RealKvHashMode.NONE:
            return "not visible in none mode (real KV bytes are not hashed)"
        if mode == RealKvHashMode.PARTIAL and fault.detail >= REAL_KV_PARTIAL_READ_BYTES:
            return (f"not visible in partial mode (byte {fault.detail} is outside the "
                    f"{REAL_KV_PARTIAL_READ_BYTES} bytes partial mode hashes)")
        return f"byte {fault.detail} of the slot's real KV"
    if fault.kind == "slot-zero":
        if compat:
            return "not visible with --compat (upstream skips slot 0 as unfilled)"
        return "seen by kvcanary's SLOT_ZERO_IN_PREFIX extension"
    if fault.kind == "swap":
        return f"positions {fault.position} and {fault.detail} exchanged"
    return fault.note


def score(faults, result) -> list:
    """Match injected faults against an audit result's findings (the target entry, and the
    exchanged entry of a swap)."""
    mode = RealKvHashMode[result.real_kv_hash_mode.upper()]
    outcomes = []
    for fault in faults:
        visible = fault.visible and not (fault.kind == "slot-zero" and result.compat)
        targets = [fault.position] + ([fault.detail] if fault.kind == "swap" else [])
        fired = 0
        for position in targets:
            for finding in result.findings_at(fault.request_row, position):
                fired |= finding.violation.fail_reason_bits
        detected = (fired & fault.expected_bits) == fault.expected_bits and fired != 0
        outcomes.append(FaultOutcome(kind=fault.kind, request_row=fault.request_row,
                                     position=fault.position, slot=fault.slot,
                                     expected_bits=fault.expected_bits, visible=visible,
                                     detected=detected, fired_bits=fired,
                                     note=fault_note(fault, mode, result.compat)))
    return outcomes
