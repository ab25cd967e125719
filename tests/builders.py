"""Small builders shared by the tests (numpy reference now, kernel tests later).

Everything here builds inputs; nothing computes an expected result. Expected values come
from upstream's golden data (docs/format.md) or from the independent oracle in ``tests/oracle.py``.
"""

from __future__ import annotations

import numpy as np

import kvcanary as kc

H0 = 0xDE7FAE23A9A1B716  # splitmix64(CANARY_CHAIN_ANCHOR), docs/format.md §3
MASK64 = (1 << 64) - 1


def signed(value: int) -> int:
    """uint64 bits as the int64 stored in a canary or violation field."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def make_canary(num_slots: int = 32, slot_bytes: int = 32) -> np.ndarray:
    """A zeroed canary buffer ``uint8[num_slots, slot_bytes]``."""
    return np.zeros((num_slots, slot_bytes), dtype=np.uint8)


def fields(canary: np.ndarray) -> np.ndarray:
    """The ``int64[N, 4]`` record view of a canary buffer (writes land in the buffer)."""
    return canary.view("<i8")[:, :4]


def stamp(canary: np.ndarray, slot: int, token: int, position: int, prev_hash: int,
          real_kv_hash: int = 0) -> None:
    """Write one record by hand (hashes given as unsigned or signed ints)."""
    fields(canary)[slot] = [signed(token), signed(position), signed(prev_hash),
                            signed(real_kv_hash)]


def make_sources(count: int, num_slots: int, *, bytes_per_token: int = 16,
                 read_bytes: int | None = None, page_size: int = 1, row_gap: int = 0,
                 fill: str = "constant", seed: int = 0, dtype=np.uint8) -> list:
    """``count`` real-KV sources covering ``num_slots`` slots.

    fill ``"constant"``: source ``i`` is the byte ``(i + 1) * 17`` everywhere (upstream's
    test fixture); ``"random"``: random bytes. ``row_gap`` adds that many foreign bytes
    (the complement of the fill) after each row, so rows are strided views."""
    sources = []
    rng = np.random.default_rng(seed)
    rows = -(-num_slots // page_size)
    row_bytes = page_size * bytes_per_token
    for i in range(count):
        backing = np.empty((rows, row_bytes + row_gap), dtype=np.uint8)
        if fill == "constant":
            backing[:, :row_bytes] = (i + 1) * 17
        else:
            backing[:, :row_bytes] = rng.integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
        backing[:, row_bytes:] = ~np.uint8((i + 1) * 17)
        view = backing[:, :row_bytes]
        if np.dtype(dtype) != np.uint8:
            view = backing.view(dtype)[:, : row_bytes // np.dtype(dtype).itemsize]
        sources.append(kc.RealKvSource(view, page_size=page_size,
                                       num_bytes_per_token=bytes_per_token,
                                       read_bytes=read_bytes or bytes_per_token))
    return sources


def source_slot_bytes(source, slot: int) -> np.ndarray:
    """Writable view of the ``num_bytes_per_token`` bytes of ``slot`` in ``source``."""
    rows = source.tensor.view(np.uint8) if source.tensor.dtype != np.uint8 else source.tensor
    begin = (slot % source.page_size) * source.num_bytes_per_token
    return rows[slot // source.page_size, begin:begin + source.num_bytes_per_token]


def make_context(num_slots: int = 32, ring_capacity: int = 64, sources=(),
                 mode=kc.RealKvHashMode.NONE, *, kernel_kind=kc.LaunchTag.HEAD_K_FULL,
                 canary=None, chain_position_assert: int = 1,
                 max_real_kv_sources: int = kc.MAX_REAL_KV_SOURCES,
                 extensions: bool = True) -> kc.CanaryContext:
    """A context on a zeroed buffer (or ``canary``) with fresh counters and log."""
    return kc.CanaryContext(
        make_canary(num_slots) if canary is None else canary,
        kernel_kind=kernel_kind,
        violation_log=kc.ViolationLog.allocate(ring_capacity),
        slot_run_counter=np.zeros(1, dtype=np.int64),
        kernel_run_counter=np.zeros(1, dtype=np.int64),
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=mode,
        enable_chain_position_assert=np.array([chain_position_assert], dtype=np.int32),
        max_real_kv_sources=max_real_kv_sources,
        extensions=extensions,
    )


def make_verify_plan(slots, positions, prevs, expected_tokens=None, *, capacity=None,
                     num_valid=None, enable: int = 1) -> kc.VerifyPlan:
    """A VerifyPlan holding the given entries (capacity defaults to max(n, 1))."""
    n = len(slots)
    capacity = max(n, 1) if capacity is None else capacity
    plan = kc.VerifyPlan.allocate(capacity)
    plan.verify_slot_indices[:n] = slots
    plan.verify_expected_positions[:n] = positions
    plan.verify_prev_slot_indices[:n] = prevs
    if expected_tokens is not None:
        plan.verify_expected_tokens[:n] = expected_tokens
    plan.verify_num_valid[0] = n if num_valid is None else num_valid
    plan.enable[0] = enable
    return plan


def make_write_plan(counts, seeds, *, capacity=None, num_valid=None) -> kc.WritePlan:
    """A WritePlan whose request ``r`` owns ``counts[r]`` consecutive token entries."""
    n = len(counts)
    capacity = max(n, 1) if capacity is None else capacity
    plan = kc.WritePlan.allocate(capacity)
    plan.write_offsets[1:n + 1] = np.cumsum(np.asarray(counts, dtype=np.int64))
    plan.write_seed_slot_indices[:n] = seeds
    plan.write_num_valid_reqs[0] = n if num_valid is None else num_valid
    return plan


def i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def write_tokens(ctx, slots, tokens, positions, *, seed: int = -1, expected_tokens=None,
                 expected_positions=None) -> None:
    """One request's write launch of consecutive tokens into ``slots``."""
    plan = make_write_plan([len(slots)], [seed])
    kc.write(ctx, plan, input_ids=i64(tokens), positions=i64(positions),
             out_cache_loc=i64(slots),
             expected_input_tokens=None if expected_tokens is None else i64(expected_tokens),
             expected_input_positions=None if expected_positions is None
             else i64(expected_positions))


def ring_rows(ctx) -> list[tuple]:
    """The valid violation rows of a context's log as tuples of ints."""
    return [tuple(int(v) for v in row) for row in ctx.violation_log.rows()]


def ring_bits(ctx) -> list[int]:
    return [row[7] for row in ring_rows(ctx)]


def counters(ctx) -> tuple[int, int, int]:
    """(write_index, slot_run_counter, kernel_run_counter)."""
    return (int(ctx.violation_log.write_index[0]), int(ctx.slot_run_counter[0]),
            int(ctx.kernel_run_counter[0]))


def linear_req_to_token(max_reqs: int, max_seq_len: int, dtype=np.int32) -> np.ndarray:
    """Upstream's ``linear`` table: ``req_to_token[rp, pos] = rp * max_seq_len + pos``."""
    return (np.arange(max_reqs * max_seq_len, dtype=np.int64)
            .reshape(max_reqs, max_seq_len).astype(dtype))


def run_plan(req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, *,
             verify_capacity=None, write_capacity=None, **kwargs):
    """Allocate plans (loose capacities by default), run ``kc.plan``, return both."""
    rows = i64(req_pool_indices)
    need = int(np.maximum(i64(prefix_lens), 0)[rows != 0].sum()) if rows.size else 0
    verify_plan = kc.VerifyPlan.allocate(verify_capacity or max(need + 64, 128))
    write_plan = kc.WritePlan.allocate(write_capacity or max(rows.size + 4, 8))
    kc.plan(req_pool_indices=rows, prefix_lens=i64(prefix_lens),
            extend_seq_lens=i64(extend_seq_lens), req_to_token=req_to_token,
            verify_plan=verify_plan, write_plan=write_plan, **kwargs)
    return verify_plan, write_plan


class DLPackOnly:
    """A foreign array: exposes only the DLPack protocol of a numpy array it wraps."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()
