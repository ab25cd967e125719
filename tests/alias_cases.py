"""Arguments of one launch that share memory across objects, as cases both backends run:
tests/api/test_cross_object_aliasing.py on numpy arrays (the reference), tests/cupy_stub.py on
cupy arrays over made-up device addresses (the CUDA path, no device needed).

Each case takes a world (a context with real-KV sources, a verify plan, a write plan, the
batch and token arrays, as :class:`cupy_stub.World` builds them) and an ``alias(target,
shape, dtype)`` that makes an array over ``target``'s first bytes, rewires one argument onto
another, and names the launch and the two arguments the error must name (None: the aliasing
is legal, both arrays are only read, and the launch runs)."""

from __future__ import annotations

import numpy as np

from kvcanary import (CanaryContext, RealKvHashMode, RealKvSource, VerifyPlan, ViolationLog,
                      WritePlan)

I64, I32, U8 = np.int64, np.int32, np.uint8


def _log(w):
    return w.context.violation_log


def _source_over(w, alias, target, rows):
    return RealKvSource(alias(target, (rows, 32), U8), page_size=1, num_bytes_per_token=32,
                        read_bytes=32)


def _set(owner, name, value):
    object.__setattr__(owner, name, value)


# case: (launch, change(world, inputs, alias), expected names or None)
CASES = {
    "verify slots over the ring": ("verify", lambda w, i, a: _set(
        w.verify_plan, "verify_slot_indices", a(_log(w).ring, (w.capacity,), I64)),
        ("violation_ring", "plan.verify_slot_indices")),
    "verify positions over the canary": ("verify", lambda w, i, a: _set(
        w.verify_plan, "verify_expected_positions", a(w.context.canary_buf, (w.capacity,), I64)),
        ("canary_buf", "plan.verify_expected_positions")),
    "verify enable over a counter": ("verify", lambda w, i, a: _set(
        w.verify_plan, "enable", a(w.context.kernel_run_counter, (1,), I32)),
        ("kernel_run_counter", "plan.enable")),
    "verify count over the write index": ("verify", lambda w, i, a: _set(
        w.verify_plan, "verify_num_valid", a(_log(w).write_index, (1,), I32)),
        ("violation_write_index", "plan.verify_num_valid")),
    "source over the canary": ("verify", lambda w, i, a: _set(
        w.context, "real_kv_sources", (_source_over(w, a, w.context.canary_buf, w.num_slots),)),
        ("canary_buf", "real_kv_sources[0].tensor")),
    "source over the ring": ("write", lambda w, i, a: _set(
        w.context, "real_kv_sources", (w.context.real_kv_sources[0],
                                       _source_over(w, a, _log(w).ring, 16))),
        ("violation_ring", "real_kv_sources[1].tensor")),
    "input_ids over the canary": ("write", lambda w, i, a: i.update(
        input_ids=a(w.context.canary_buf, (w.tokens,), I64)), ("canary_buf", "input_ids")),
    "positions over the ring": ("write", lambda w, i, a: i.update(
        positions=a(_log(w).ring, (w.tokens,), I64)), ("violation_ring", "positions")),
    "a counter over out_cache_loc": ("write", lambda w, i, a: _set(
        w.context, "slot_run_counter", a(i["out_cache_loc"], (1,), I64)),
        ("slot_run_counter", "out_cache_loc")),
    "expected tokens over the ring": ("write", lambda w, i, a: i.update(
        expected_input_tokens=a(_log(w).ring, (w.tokens,), I64),
        expected_input_positions=w.device(w.tokens)),
        ("violation_ring", "expected_input_tokens")),
    "write offsets over the ring": ("write", lambda w, i, a: _set(
        w.write_plan, "write_offsets", a(_log(w).ring, (w.bs + 1,), I64)),
        ("violation_ring", "plan.write_offsets")),
    "write seeds over the canary": ("write", lambda w, i, a: _set(
        w.write_plan, "write_seed_slot_indices", a(w.context.canary_buf, (w.bs,), I64)),
        ("canary_buf", "plan.write_seed_slot_indices")),
    "req_to_token over the verify slots": ("plan", lambda w, i, a: i.update(
        req_to_token=a(w.verify_plan.verify_slot_indices, (2, 16), I32)),
        ("plan.verify_slot_indices", "req_to_token")),
    "block_table over the expected tokens": ("plan", lambda w, i, a: i.update(
        req_to_token=None, block_size=4,
        block_table=a(w.verify_plan.verify_expected_tokens, (2, 8), I64)),
        ("plan.verify_expected_tokens", "block_table")),
    "prefix_lens over the write offsets": ("plan", lambda w, i, a: i.update(
        prefix_lens=a(w.write_plan.write_offsets, (w.bs,), I64)),
        ("plan.write_offsets", "prefix_lens")),
    "the swa mapping over the predecessors": ("plan", lambda w, i, a: i.update(
        full_to_swa_index_mapping=a(w.verify_plan.verify_prev_slot_indices, (w.capacity,), I64)),
        ("plan.verify_prev_slot_indices", "full_to_swa_index_mapping")),
    "the verify plan over the write plan": ("plan", lambda w, i, a: _set(
        w.verify_plan, "verify_num_valid", a(w.write_plan.write_num_valid_reqs, (1,), I32)),
        ("plan.verify_num_valid", "plan.write_num_valid_reqs")),
    # Legal: arrays a launch only reads may share memory.
    "input_ids and positions one array": ("write", lambda w, i, a: i.update(
        positions=i["input_ids"]), None),
    "two sources over one tensor": ("write", lambda w, i, a: _set(
        w.context, "real_kv_sources", (w.context.real_kv_sources[0],) * 2), None),
    "expected tokens table over req_to_token": ("plan", lambda w, i, a: i.update(
        req_to_verify_expected_tokens=i["req_to_token"]), None),
}


def run_case(kc, world, alias, case: str) -> str:
    """``"ok"`` when the launch does what the case expects, else what it did."""
    launch, change, expected = CASES[case]
    inputs = world.plan_inputs() if launch == "plan" else \
        world.token_inputs() if launch == "write" else {}
    change(world, inputs, alias)
    try:
        if launch == "plan":
            kc.plan(**inputs)
        elif launch == "write":
            kc.write(world.context, world.write_plan, **inputs)
        else:
            kc.verify(world.context, world.verify_plan)
    except ValueError as exc:
        message = str(exc)
        if expected is None:
            return f"legal aliasing refused: {message}"
        named = all(name in message for name in expected) and "share memory" in message
        return "ok" if named else f"unclear: {message}"
    return "ok" if expected is None else "accepted"


def numpy_alias(target, shape, dtype):
    """An array over ``target``'s first bytes (host memory)."""
    flat = target.reshape(-1).view(np.uint8)
    return np.ndarray(shape, dtype, buffer=flat)


class NumpyWorld:
    """:class:`cupy_stub.World` on numpy arrays: hashing on with two sources."""

    def __init__(self, *, num_slots: int = 64, capacity: int = 16, bs: int = 3, tokens: int = 5):
        self.num_slots, self.capacity, self.bs, self.tokens = num_slots, capacity, bs, tokens
        sources = tuple(RealKvSource(np.zeros((num_slots, 32), np.uint8), page_size=1,
                                     num_bytes_per_token=32, read_bytes=32) for _ in range(2))
        self.context = CanaryContext(
            np.zeros((num_slots, 32), np.uint8), kernel_kind=0,
            violation_log=ViolationLog.allocate(8), slot_run_counter=np.zeros(1, np.int64),
            kernel_run_counter=np.zeros(1, np.int64), real_kv_sources=sources,
            real_kv_hash_mode=RealKvHashMode.ALL)
        self.verify_plan = VerifyPlan.allocate(capacity)
        self.write_plan = WritePlan.allocate(bs)

    def device(self, shape, dtype=np.int64):
        return np.zeros(shape, dtype)

    def plan_inputs(self) -> dict:
        return dict(req_pool_indices=self.device(self.bs), prefix_lens=self.device(self.bs),
                    extend_seq_lens=self.device(self.bs),
                    req_to_token=self.device((4, 32), np.int32),
                    verify_plan=self.verify_plan, write_plan=self.write_plan,
                    swa_window_size=8, full_to_swa_index_mapping=self.device(self.num_slots),
                    req_to_verify_expected_tokens=self.device((4, 32), np.int32),
                    req_to_verify_expected_tokens_valid_lens=self.device(self.bs))

    def token_inputs(self) -> dict:
        return dict(input_ids=self.device(self.tokens), positions=self.device(self.tokens),
                    out_cache_loc=self.device(self.tokens))
