"""The memory a forward pass writes, and the pass itself: the canary records, the real KV of
every source (bytes deterministic per token, position and source), how often each canary slot
was written, and the canary launches of a step (plan, verify every ``verify_every`` steps, TAIL
write). A violation in this honest simulation is a bug and raises."""

from __future__ import annotations

import numpy as np

from ..api import launches as api
from ..format.consts import CANARY_SLOT_BYTES, LaunchTag
from ..format.hashing import splitmix64_inplace, splitmix64_mix3
from ..model.types import CanaryContext, RealKvSource, VerifyPlan, ViolationLog, WritePlan
from .config import SOURCE_DTYPES, Stats, SynthConfig, SynthError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
VIOLATION_LOG_CAPACITY = 1024


class KvPool:
    def __init__(self, config: SynthConfig, num_slots: int):
        self.config = c = config
        self.page_size = ps = c.page_size
        self.canary = np.zeros((num_slots, CANARY_SLOT_BYTES), dtype=np.uint8)
        self.write_count = np.zeros(num_slots, dtype=np.uint32)
        self.sources = []
        rows = -(-num_slots // ps)
        for i in range(c.sources):
            dtype = np.dtype(SOURCE_DTYPES[i % len(SOURCE_DTYPES)])
            width = ps * c.bytes_per_token // dtype.itemsize
            self.sources.append(np.zeros((rows, width), dtype=dtype))
        self.tag = LaunchTag.TAIL_K_SWA if c.swa_window > 0 else LaunchTag.TAIL_K_FULL
        self.context = CanaryContext(
            self.canary, kernel_kind=self.tag,
            violation_log=ViolationLog.allocate(VIOLATION_LOG_CAPACITY),
            slot_run_counter=np.zeros(1, dtype=np.int64),
            kernel_run_counter=np.zeros(1, dtype=np.int64),
            real_kv_sources=tuple(self._source(t) for t in self.sources),
            real_kv_hash_mode=c.hash_mode, max_real_kv_sources=max(4, c.sources))
        self.write_plan = WritePlan.allocate(c.max_running)

    def _source(self, tensor) -> RealKvSource:
        bpt = self.config.bytes_per_token
        return RealKvSource(tensor, page_size=self.page_size, num_bytes_per_token=bpt,
                            read_bytes=bpt)

    def kv_bytes(self, tokens: np.ndarray, positions: np.ndarray, source: int) -> np.ndarray:
        """``uint8 [n, bytes_per_token]``: the deterministic KV bytes of each token."""
        words = self.config.bytes_per_token // 8
        base = splitmix64_mix3(tokens.astype(np.int64), positions.astype(np.int64),
                               np.full(tokens.shape, source + 1, dtype=np.int64))
        out = base[:, None] ^ (np.arange(1, words + 1, dtype=np.uint64) * _GOLDEN)[None, :]
        splitmix64_inplace(out.reshape(-1))
        return out.view(np.uint8).reshape(tokens.shape[0], self.config.bytes_per_token)

    def slot_bytes(self, tensor) -> np.ndarray:
        """A source tensor as ``uint8 [pages, page_size, bytes_per_token]``."""
        return tensor.view(np.uint8).reshape(-1, self.page_size, self.config.bytes_per_token)

    def write_kv(self, canary_slots: np.ndarray, tokens: np.ndarray,
                 positions: np.ndarray) -> None:
        ps = self.page_size
        for index, tensor in enumerate(self.sources):
            self.slot_bytes(tensor)[canary_slots // ps, canary_slots % ps] = self.kv_bytes(
                tokens, positions, index)

    def forward(self, *, rows, prefix, extend, tokens, positions, out_loc, table: dict,
                expected_tokens, lut, verify_now: bool, step: int, stats: Stats) -> None:
        """One step's writes: the real KV of the new tokens first (as the model's forward
        does), then the canary plan, verify and write. ``table`` is the slot table keyword
        of ``kvcanary.plan``."""
        c = self.config
        reused = self.write_count[out_loc] > 0
        stats.slots_reused += int(reused.sum())
        self.write_count[out_loc] += 1
        self.write_kv(out_loc, tokens, positions)

        if verify_now:
            starts = (np.maximum(0, prefix - c.swa_window) if c.swa_window > 0
                      else np.zeros_like(prefix))
            capacity = max(1, int((prefix - starts).sum()))
        else:
            capacity = 1
        verify_plan = VerifyPlan.allocate(capacity)
        backend = c.backend
        api.plan(req_pool_indices=rows, prefix_lens=prefix, extend_seq_lens=extend,
                 verify_plan=verify_plan, write_plan=self.write_plan,
                 swa_window_size=c.swa_window, full_to_swa_index_mapping=lut,
                 req_to_verify_expected_tokens=expected_tokens,
                 req_to_verify_expected_tokens_valid_lens=prefix.copy(), backend=backend,
                 check_capacity=verify_now, **table)   # a step not verified plans no entries
        log = self.context.violation_log
        if verify_now:
            api.verify(self.context, verify_plan, check_expected_token=True, backend=backend)
            stats.verify_launches += 1
            stats.entries_verified += int(verify_plan.verify_num_valid[0])
        api.write(self.context, self.write_plan, input_ids=tokens, positions=positions,
                  out_cache_loc=out_loc, backend=backend)
        if log.total:
            raise SynthError("internal: the honest simulation produced canary violations "
                             f"at step {step}:\n" + "\n".join(
                                 v.log_line() for v in log.violations()[:5]))
