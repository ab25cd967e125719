"""Fuzzing ``kc.plan``, ``kc.write`` and ``kc.verify`` with invalid and extreme inputs.

Every example builds its arrays twice inside guard bytes (tests/fuzz_support.py): once for the
numpy reference alone, once for the CPU-compiled kernels behind the ``Differential`` backend
(reference on copies, kernels on the guarded arrays, byte comparison). Each call must either
succeed identically on both, or raise ``ValueError``/``TypeError`` with a ``kv-canary:``
message naming an argument; never another exception, a hang, a changed input or a write
outside the arrays it was given. The one documented divergence (docs/extensions.md): the
reference raises on a SWA LUT index past the LUT, where the kernels mark the entry
``PLAN_SLOT_OUT_OF_TABLE``; such examples run the kernels alone as well.

``test_fuzz_sanitizers.py`` reruns this module against the ASan/UBSan build of the kernels.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcanary as kc
from fuzz_support import Guards, fuzz_settings, hang_guard
from kernel_harness import Differential, numpy_runs
from kernel_harness.fixtures import cpu_kernels  # noqa: F401

pytestmark = [pytest.mark.fuzz,
              # int64 counters near their limit wrap, as in the kernels; numpy warns.
              pytest.mark.filterwarnings("ignore:overflow encountered in scalar add")]

I64_MAX, I64_MIN = (1 << 63) - 1, -(1 << 63)
EXTREMES = [0, 1, -1, 2, (1 << 31) - 1, -(1 << 31), 1 << 31, 1 << 32, 1 << 62, -(1 << 62),
            I64_MAX, I64_MIN, I64_MAX - 1, I64_MIN + 1]
MARK = (1 << 63) - 1
SETTINGS = fuzz_settings(400)

# Mutations that turn one argument invalid (or merely unusual: a read-only input is fine).
MUTATIONS = ("dtype", "float", "ndim", "length", "strided", "misaligned", "readonly", "list")

# Errors valid (unmutated) arguments may still raise, documented on the API.
DOCUMENTED = ("outside full_to_swa_index_mapping length", "exceeds write_req_capacity",
              "row is too narrow", "violation_ring must have shape [N, 8] with N >= 1",
              "entries but the write plan covers", "past int64: no plan can hold them")


def mixed(lo: int, hi: int):
    """Small values around the interesting range, or an int64 extreme."""
    return st.one_of(st.integers(lo, hi), st.sampled_from(EXTREMES))


def int_list(lo, hi, min_size=0, max_size=8):
    return st.lists(mixed(lo, hi), min_size=min_size, max_size=max_size)


def count_of(capacity: int):
    """An int32 count: the capacity, near it, or an int32 extreme."""
    return st.one_of(st.just(capacity), st.integers(-3, capacity + 3),
                     st.sampled_from([(1 << 31) - 1, -(1 << 31)]))


def mutation():
    return st.one_of(st.none(), st.sampled_from(MUTATIONS))


class Maker:
    """Builds the arguments of one example from drawn plain values, applying at most one
    mutation; called once per backend so both see identical arrays."""

    def __init__(self, guards: Guards, target: str | None, kind: str | None):
        self.g, self.target, self.kind = guards, target, kind
        self.inputs = []  # (name, array, copy): must be unchanged after the call

    def __call__(self, name, values, dtype, *, shape=None, output=False):
        values = np.asarray(values, dtype=np.int64 if np.dtype(dtype).kind in "iu" else dtype)
        if np.dtype(dtype) == np.uint8:
            values = np.asarray(values).astype(np.uint8)
        if shape is not None:
            values = values.reshape(shape)
        kind = self.kind if name == self.target else None
        if kind == "dtype":
            array = self.g.array(values, np.int32 if np.dtype(dtype) != np.int32 else np.int64)
        elif kind == "float":
            array = self.g.array(values.astype(np.float64), np.float64)
        elif kind == "ndim":
            array = self.g.array(values.reshape((1,) + values.shape), dtype)
        elif kind == "length":
            extra = np.zeros((1,) + values.shape[1:], dtype=values.dtype)
            array = self.g.array(np.concatenate([values, extra]) if values.ndim else values, dtype)
        elif kind == "strided":
            array = self.g.strided(values, dtype)
        elif kind == "misaligned":
            array = self.g.array(values, dtype, misalign=1 if np.dtype(dtype).itemsize > 1 else 4)
        elif kind == "list":
            return values.tolist()
        else:
            array = self.g.array(values, dtype)
        if kind == "readonly":
            array.flags.writeable = False
        if not output:
            self.inputs.append((name, array, array.copy()))
        return array

    def check_inputs(self) -> None:
        for name, array, before in self.inputs:
            if not np.array_equal(array, before, equal_nan=array.dtype.kind == "f"):
                raise AssertionError(f"input {name} changed")


def run_on_both_backends(build, cpu_kernels, names) -> None:  # noqa: F811
    """``build(guards)`` makes the arguments of one example (a ``Maker`` whose ``launch()``
    runs it). Run on the reference, then behind the Differential backend (and on the kernels
    alone for the LUT divergence); check outcomes, guard bytes and inputs each time."""
    outcomes = []
    for backend in ("reference", "differential", "kernels"):
        if backend == "kernels" and not _lut_divergence(outcomes[0]):
            break
        guards = Guards()
        maker = build(guards)
        if backend == "reference":
            runner = contextlib.nullcontext()
        elif backend == "differential":
            runner = numpy_runs(Differential(cpu_kernels))
        else:
            runner = numpy_runs(cpu_kernels)
        with hang_guard(), runner:
            try:
                maker.launch()
                outcome = None
            except (ValueError, TypeError) as exc:
                outcome = exc
        guards.check()
        maker.check_inputs()
        outcomes.append(outcome)
        if backend == "kernels":
            assert outcome is None, f"kernels raised on the LUT divergence: {outcome}"
            maker.check_marked()
    reference, differential = outcomes[:2]
    assert type(reference) is type(differential)
    assert str(reference) == str(differential)
    if reference is not None:
        message = str(reference)
        assert message.startswith("kv-canary: "), message
        if maker.mutated is None:
            assert any(text in message for text in DOCUMENTED), message
        else:
            assert any(text in message for text in names + DOCUMENTED), message


def _lut_divergence(outcome) -> bool:
    return outcome is not None and "outside full_to_swa_index_mapping length" in str(outcome)


# --------------------------------------------------------------------------- plan

PLAN_NAMES = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token",
              "full_to_swa_index_mapping", "req_to_verify_expected_tokens",
              "req_to_verify_expected_tokens_valid_lens", "plan.verify_slot_indices",
              "plan.verify_expected_tokens", "plan.verify_expected_positions",
              "plan.verify_prev_slot_indices", "plan.verify_num_valid", "plan.enable",
              "plan.write_offsets", "plan.write_seed_slot_indices", "plan.write_num_valid_reqs",
              "swa_window_size", "kv_token_id_vs_position_offset", "write_offsets")


@st.composite
def plan_inputs(draw):
    bs = draw(st.integers(0, 5))
    rows, cols = draw(st.integers(0, 4)), draw(st.integers(0, 6))
    table = draw(st.lists(mixed(-2, 24), min_size=rows * cols, max_size=rows * cols))
    lut = draw(st.none() | int_list(-2, 30, 0, 24))
    swa = draw(st.one_of(st.integers(0, 5), st.sampled_from([-1, 1 << 62, I64_MAX, I64_MIN])))
    if swa > 0 and lut is None:
        lut = list(range(24))
    pool_shape = draw(st.none() | st.tuples(st.integers(0, 5), st.integers(0, 7)))
    return dict(
        bs=bs, rows=rows, cols=cols, table=table,
        table_dtype=draw(st.sampled_from([np.int32, np.int64])),
        req_pool_indices=draw(int_list(-1, rows + 1, bs, bs)),
        prefix_lens=draw(int_list(-3, cols + 2, bs, bs)),
        extend_seq_lens=draw(int_list(-3, 6, bs, bs)),
        verify_capacity=draw(st.integers(0, 40)),
        write_capacity=bs + draw(st.integers(-1, 3)),
        lut=lut, swa=swa,
        pool_shape=pool_shape,
        pool=None if pool_shape is None else draw(st.lists(
            mixed(-5, 100), min_size=pool_shape[0] * pool_shape[1],
            max_size=pool_shape[0] * pool_shape[1])),
        pool_dtype=draw(st.sampled_from([np.int32, np.int64])),
        valid_lens=draw(int_list(-2, 9, bs, bs)),
        offset=draw(st.one_of(st.integers(-3, 3), st.sampled_from(EXTREMES),
                              st.sampled_from([1 << 64, -(1 << 70)]))),
        target=draw(st.sampled_from(PLAN_TARGETS)),
        kind=draw(mutation()),
    )


def build_plan(p):
    def build(guards):
        m = Maker(guards, p["target"], p["kind"])
        bs, vcap, wcap = p["bs"], p["verify_capacity"], max(0, p["write_capacity"])
        table = m("req_to_token", p["table"], p["table_dtype"], shape=(p["rows"], p["cols"]))
        lut = None if p["lut"] is None else m("full_to_swa_index_mapping", p["lut"], np.int64)
        pool = valid = None
        if p["pool"] is not None:
            pool = m("req_to_verify_expected_tokens", p["pool"], p["pool_dtype"],
                     shape=p["pool_shape"])
            valid = m("req_to_verify_expected_tokens_valid_lens", p["valid_lens"], np.int64)
        verify_plan = kc.VerifyPlan(
            *(m(f"plan.{name}", np.full(vcap, 7), np.int64, output=True)
              for name in kc.VerifyPlan.FIELDS),
            verify_num_valid=m("plan.verify_num_valid", [3], np.int32, output=True),
            enable=m("plan.enable", [1], np.int32, output=True))
        write_plan = kc.WritePlan(
            write_offsets=m("plan.write_offsets", np.full(wcap + 1, 9), np.int64, output=True),
            write_seed_slot_indices=m("plan.write_seed_slot_indices", np.full(wcap, 9), np.int64,
                                      output=True),
            write_num_valid_reqs=m("plan.write_num_valid_reqs", [2], np.int32, output=True))
        args = dict(
            req_pool_indices=m("req_pool_indices", p["req_pool_indices"], np.int64),
            prefix_lens=m("prefix_lens", p["prefix_lens"], np.int64),
            extend_seq_lens=m("extend_seq_lens", p["extend_seq_lens"], np.int64),
            req_to_token=table, verify_plan=verify_plan, write_plan=write_plan,
            swa_window_size=p["swa"], full_to_swa_index_mapping=lut,
            req_to_verify_expected_tokens=pool, req_to_verify_expected_tokens_valid_lens=valid,
            kv_token_id_vs_position_offset=p["offset"])
        m.mutated = p["kind"]
        if p["kind"] == "readonly" and not p["target"].startswith("plan."):
            m.mutated = None  # a read-only input is a valid input
        if not -(1 << 63) <= p["offset"] < 1 << 63:
            m.mutated = "offset"

        def launch():
            kc.plan(**args)

        def check_marked():
            # The kernels' plan is the reference's with the LUT padded by markers.
            n = int(verify_plan.verify_num_valid[0])
            marked = (verify_plan.verify_slot_indices[:n] == MARK).any() or \
                (verify_plan.verify_prev_slot_indices[:n] == MARK).any() or \
                (write_plan.write_seed_slot_indices[:bs] == MARK).any()
            assert marked or int(verify_plan.enable[0]) == 0

        m.launch, m.check_marked = launch, check_marked
        return m
    return build


# Random verify capacities are undersized on purpose (the overflow rule is what is fuzzed).
@pytest.mark.filterwarnings("ignore::kvcanary.VerifyPlanTooSmall")
@SETTINGS
@given(p=plan_inputs())
def test_fuzz_plan(p, cpu_kernels):  # noqa: F811
    run_on_both_backends(build_plan(p), cpu_kernels, PLAN_NAMES)


# --------------------------------------------------------------------------- write / verify

CONTEXT_NAMES = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
                 "kernel_run_counter", "enable_chain_position_assert", "real_kv_sources",
                 "RealKvSource")
WRITE_NAMES = CONTEXT_NAMES + ("input_ids", "positions", "out_cache_loc", "expected_input_tokens",
                               "expected_input_positions", "plan.write_offsets",
                               "plan.write_seed_slot_indices", "plan.write_num_valid_reqs",
                               "write_offsets")
VERIFY_NAMES = CONTEXT_NAMES + ("plan.verify_slot_indices", "plan.verify_expected_tokens",
                                "plan.verify_expected_positions", "plan.verify_prev_slot_indices",
                                "plan.verify_num_valid", "plan.enable")


@st.composite
def context_inputs(draw):
    num_slots = draw(st.integers(0, 12))
    stride = draw(st.sampled_from([32, 32, 40, 64]))
    ring_capacity = draw(st.integers(0, 8))
    sources = []
    for _ in range(draw(st.integers(0, 2))):
        sources.append(dict(
            dtype=draw(st.sampled_from([np.uint8, np.float16, np.float32, np.float64])),
            page_size=draw(st.sampled_from([1, 2, 4])),
            bytes_per_token=draw(st.sampled_from([16, 32])),
            fill=draw(st.sampled_from(["nan", "random", "inf"])),
            short=draw(st.integers(0, 7)) == 0,
            gap=draw(st.sampled_from([0, 16]))))
    return dict(
        num_slots=num_slots, stride=stride,
        canary_seed=draw(st.integers(0, 3)),
        ring_capacity=ring_capacity,
        write_index=draw(st.one_of(st.integers(-3, ring_capacity + 3),
                                   st.sampled_from([(1 << 31) - 1, (1 << 31) - 2]))),
        counter=draw(st.one_of(st.integers(0, 5), st.sampled_from([I64_MAX, -1]))),
        kind_tag=draw(st.one_of(st.integers(0, 7), st.sampled_from([-1, I64_MAX, I64_MIN]))),
        sources=sources,
        mode=draw(st.sampled_from(list(kc.RealKvHashMode))),
        position_assert=draw(st.sampled_from([1, 0, 2, -1])),
    )


def build_context(m: Maker, c, num_slots_override=None):
    num_slots = c["num_slots"]
    rng = np.random.default_rng(c["canary_seed"])
    canary = rng.integers(0, 256, size=(num_slots, c["stride"]), dtype=np.uint8)
    if c["canary_seed"] == 0:
        canary[:] = 0
    buf = m("canary_buf", canary, np.uint8, output=True)
    ring = m("violation_ring", np.full((c["ring_capacity"], 8), 3), np.int64, output=True)
    write_index = m("violation_write_index", [c["write_index"]], np.int32, output=True)
    sources = []
    for index, s in enumerate(c["sources"]):
        rows = -(-max(num_slots, 1) // s["page_size"]) - (1 if s["short"] else 0)
        row_bytes = s["page_size"] * s["bytes_per_token"]
        backing = np.random.default_rng(index).integers(
            0, 256, size=(max(rows, 0), row_bytes + s["gap"]), dtype=np.uint8)
        dtype = np.dtype(s["dtype"])
        tensor = m.g.array(backing, np.uint8).view(dtype)
        if s["fill"] != "random" and dtype.kind == "f":
            tensor[...] = np.nan if s["fill"] == "nan" else np.inf
        tensor = tensor[:, : row_bytes // dtype.itemsize]
        m.inputs.append((f"real_kv_sources[{index}].tensor", tensor, tensor.copy()))
        sources.append(kc.RealKvSource(tensor, page_size=s["page_size"],
                                       num_bytes_per_token=s["bytes_per_token"],
                                       read_bytes=s["bytes_per_token"]))
    return kc.CanaryContext(
        buf, kernel_kind=c["kind_tag"],
        violation_log=kc.ViolationLog(ring, write_index),
        slot_run_counter=m("slot_run_counter", [c["counter"]], np.int64, output=True),
        kernel_run_counter=m("kernel_run_counter", [c["counter"]], np.int64, output=True),
        real_kv_sources=sources, real_kv_hash_mode=c["mode"],
        enable_chain_position_assert=m("enable_chain_position_assert", [c["position_assert"]],
                                       np.int32))


def _mutated(target, kind, outputs) -> str | None:
    if kind is None:
        return None
    if kind == "readonly" and target not in outputs:
        return None  # a read-only input is valid
    return kind


WRITE_OUTPUTS = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
                 "kernel_run_counter")


@st.composite
def write_inputs(draw):
    n = draw(st.integers(0, 10))
    capacity = draw(st.integers(0, 5))
    offsets = draw(st.one_of(
        int_list(-2, n + 2, capacity + 1, capacity + 1),
        st.lists(st.integers(0, n), min_size=capacity + 1, max_size=capacity + 1).map(sorted),
        st.just([0] + [1 << 62] * capacity), st.just([-(1 << 62)] + [1 << 62] * capacity)))
    return dict(
        context=draw(context_inputs()), n=n, capacity=capacity, offsets=offsets,
        seeds=draw(int_list(-2, 14, capacity, capacity)),
        num_valid=draw(count_of(capacity)),
        input_ids=draw(int_list(-3, 50, n, n)),
        positions=draw(int_list(-3, 12, n, n)),
        out_cache_loc=draw(int_list(-2, 14, n, n)),
        expected=draw(st.booleans()),
        expected_tokens=draw(int_list(-3, 50, n, n)),
        expected_positions=draw(int_list(-3, 12, n, n)),
        target=draw(st.sampled_from(WRITE_TARGETS)), kind=draw(mutation()))


def build_write(w):
    def build(guards):
        m = Maker(guards, w["target"], w["kind"])
        context = build_context(m, w["context"])
        cap = w["capacity"]
        plan = kc.WritePlan(
            write_offsets=m("plan.write_offsets", w["offsets"], np.int64),
            write_seed_slot_indices=m("plan.write_seed_slot_indices", w["seeds"], np.int64),
            write_num_valid_reqs=m("plan.write_num_valid_reqs",
                                   np.array([w["num_valid"]]).astype(np.int32), np.int32))
        assert plan.write_req_capacity == cap or w["target"].startswith("plan.")
        tokens = dict(input_ids=m("input_ids", w["input_ids"], np.int64),
                      positions=m("positions", w["positions"], np.int64),
                      out_cache_loc=m("out_cache_loc", w["out_cache_loc"], np.int64))
        if w["expected"]:
            tokens["expected_input_tokens"] = m("expected_input_tokens", w["expected_tokens"],
                                                np.int64)
            tokens["expected_input_positions"] = m("expected_input_positions",
                                                   w["expected_positions"], np.int64)
        m.mutated = _mutated(w["target"], w["kind"], WRITE_OUTPUTS)

        def launch():
            kc.write(context, plan, **tokens)

        m.launch = launch
        return m
    return build


@SETTINGS
@given(w=write_inputs())
def test_fuzz_write(w, cpu_kernels):  # noqa: F811
    run_on_both_backends(build_write(w), cpu_kernels, WRITE_NAMES)


VERIFY_OUTPUTS = ("violation_ring", "violation_write_index", "slot_run_counter",
                  "kernel_run_counter")


@st.composite
def verify_inputs(draw):
    capacity = draw(st.integers(0, 12))
    return dict(
        context=draw(context_inputs()), capacity=capacity,
        slots=draw(int_list(-2, 14, capacity, capacity)),
        tokens=draw(int_list(-2, 50, capacity, capacity)),
        positions=draw(int_list(-2, 12, capacity, capacity)),
        prevs=draw(int_list(-2, 14, capacity, capacity)),
        num_valid=draw(count_of(capacity)),
        enable=draw(st.sampled_from([1, 0, 2, -1])),
        check_token=draw(st.booleans()),
        target=draw(st.sampled_from(VERIFY_TARGETS)), kind=draw(mutation()))


def build_verify(v):
    def build(guards):
        m = Maker(guards, v["target"], v["kind"])
        context = build_context(m, v["context"])
        plan = kc.VerifyPlan(
            verify_slot_indices=m("plan.verify_slot_indices", v["slots"], np.int64),
            verify_expected_tokens=m("plan.verify_expected_tokens", v["tokens"], np.int64),
            verify_expected_positions=m("plan.verify_expected_positions", v["positions"],
                                        np.int64),
            verify_prev_slot_indices=m("plan.verify_prev_slot_indices", v["prevs"], np.int64),
            verify_num_valid=m("plan.verify_num_valid",
                               np.array([v["num_valid"]]).astype(np.int32), np.int32),
            enable=m("plan.enable", [v["enable"]], np.int32))
        # verify only reads the canary (a read-only one is valid): it must stay unchanged.
        m.inputs.append(("canary_buf", context.canary_buf, np.array(context.canary_buf)))
        m.mutated = _mutated(v["target"], v["kind"], VERIFY_OUTPUTS)

        def launch():
            kc.verify(context, plan, check_expected_token=v["check_token"])

        m.launch = launch
        return m
    return build


@SETTINGS
@given(v=verify_inputs())
def test_fuzz_verify(v, cpu_kernels):  # noqa: F811
    run_on_both_backends(build_verify(v), cpu_kernels, VERIFY_NAMES)


# --------------------------------------------------------------------------- every mutation
# Random draws hit a given (argument, mutation) pair only now and then; this sweep makes
# every pair happen on a few random bases.

PLAN_TARGETS = PLAN_NAMES[:16]
WRITE_TARGETS = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
                 "kernel_run_counter", "enable_chain_position_assert", "input_ids", "positions",
                 "out_cache_loc", "expected_input_tokens", "expected_input_positions",
                 "plan.write_offsets", "plan.write_seed_slot_indices", "plan.write_num_valid_reqs")
VERIFY_TARGETS = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
                  "kernel_run_counter", "plan.verify_slot_indices", "plan.verify_expected_tokens",
                  "plan.verify_expected_positions", "plan.verify_prev_slot_indices",
                  "plan.verify_num_valid", "plan.enable")
SWEEP = fuzz_settings(2, share=100)
LAUNCHES = {"plan": (plan_inputs, build_plan, PLAN_NAMES),
            "write": (write_inputs, build_write, WRITE_NAMES),
            "verify": (verify_inputs, build_verify, VERIFY_NAMES)}


@pytest.mark.parametrize("launch,target", [("plan", t) for t in PLAN_TARGETS]
                         + [("write", t) for t in WRITE_TARGETS]
                         + [("verify", t) for t in VERIFY_TARGETS])
@pytest.mark.parametrize("kind", MUTATIONS)
def test_every_argument_mutated(launch, target, kind, cpu_kernels):  # noqa: F811
    strategy, build, names = LAUNCHES[launch]

    @SWEEP
    @given(base=strategy())
    def run(base):
        drawn = dict(base, target=target, kind=kind)
        run_on_both_backends(build(drawn), cpu_kernels, names)

    run()


# --------------------------------------------------------------------------- regressions
# Inputs the fuzzing above found, pinned so a regression fails without hypothesis' luck.


def _small_context(num_slots, **kwargs):
    return kc.CanaryContext(
        np.zeros((num_slots, 32), np.uint8), kernel_kind=0,
        violation_log=kc.ViolationLog.allocate(4), slot_run_counter=np.zeros(1, np.int64),
        kernel_run_counter=np.zeros(1, np.int64), **kwargs)


def _verify_plan(slots, prevs):
    n = len(slots)
    return kc.VerifyPlan(np.array(slots, np.int64), np.full(n, -1, np.int64),
                         np.arange(n, dtype=np.int64), np.array(prevs, np.int64),
                         np.array([n], np.int32), np.ones(1, np.int32))


def test_verify_on_a_buffer_of_zero_slots_reports_out_of_range():
    context = _small_context(0)
    kc.verify(context, _verify_plan([5, 0, -3], [2, -1, 1]))
    assert [v.slot_idx for v in context.violation_log.violations()] == [5, -3]


def test_read_only_plan_output_is_refused_before_any_write():
    verify_plan, write_plan = kc.VerifyPlan.allocate(4), kc.WritePlan.allocate(1)
    verify_plan.verify_prev_slot_indices.flags.writeable = False
    before = [a.copy() for a in (verify_plan.verify_slot_indices, write_plan.write_offsets)]
    with pytest.raises(ValueError, match="plan.verify_prev_slot_indices is read-only"):
        kc.plan(req_pool_indices=np.array([1]), prefix_lens=np.array([2]),
                extend_seq_lens=np.array([1]), req_to_token=np.arange(8).reshape(2, 4),
                verify_plan=verify_plan, write_plan=write_plan)
    assert np.array_equal(before[0], verify_plan.verify_slot_indices)
    assert np.array_equal(before[1], write_plan.write_offsets)


def test_read_only_canary_is_refused_by_write_and_accepted_by_verify():
    context = _small_context(4)
    context.canary_buf.flags.writeable = False
    kc.verify(context, _verify_plan([1], [-1]))
    with pytest.raises(ValueError, match="canary_buf is read-only"):
        kc.write(context, kc.WritePlan.allocate(1), input_ids=np.array([1]),
                 positions=np.array([0]), out_cache_loc=np.array([1]))


@pytest.mark.parametrize("name", ["kv_token_id_vs_position_offset", "swa_window_size"])
def test_plan_scalars_outside_int64_are_refused(name):
    with pytest.raises(ValueError, match=f"kv-canary: {name} must fit in int64"):
        kc.plan(req_pool_indices=np.array([1]), prefix_lens=np.array([2]),
                extend_seq_lens=np.array([1]), req_to_token=np.arange(8).reshape(2, 4),
                verify_plan=kc.VerifyPlan.allocate(4), write_plan=kc.WritePlan.allocate(1),
                full_to_swa_index_mapping=np.arange(8), **{name: 1 << 70})


def test_kernel_kind_outside_int64_is_refused():
    with pytest.raises(ValueError, match="kv-canary: kernel_kind must fit in int64"):
        kc.CanaryContext(np.zeros((4, 32), np.uint8), kernel_kind=1 << 70,
                         violation_log=kc.ViolationLog.allocate(4),
                         slot_run_counter=np.zeros(1, np.int64),
                         kernel_run_counter=np.zeros(1, np.int64))


def test_misaligned_canary_is_refused():
    backing = np.zeros(4 * 32 + 8, np.uint8)
    canary = backing[4:4 + 4 * 32].reshape(4, 32)
    context = _small_context(4)
    context.canary_buf = canary
    with pytest.raises(ValueError, match="canary_buf must be aligned to 8 bytes"):
        kc.verify(context, _verify_plan([1], [-1]))


def test_negative_write_index_keeps_rows_whose_number_reaches_the_ring(cpu_kernels):  # noqa: F811
    """Each row claims the next sequence number; a row lands when its number is inside the
    ring, as in the kernels' per-row append (the reference used to drop the whole batch)."""
    for backend in (contextlib.nullcontext(), numpy_runs(Differential(cpu_kernels))):
        context = _small_context(0)
        context.violation_log.write_index[0] = -1
        with backend:
            kc.verify(context, _verify_plan([5, 6, 7], [-1, -1, -1]))
        assert int(context.violation_log.write_index[0]) == 2
        assert [r[1] for r in context.violation_log.ring[:2].tolist()] == [6, 7]


def test_misaligned_int64_argument_is_refused():
    guards = Guards()
    slots = guards.array(np.arange(4), np.int64, misalign=4)
    with pytest.raises(ValueError, match="plan.verify_slot_indices must be aligned to 8 bytes"):
        kc.verify(_small_context(4), kc.VerifyPlan(
            slots, np.zeros(4, np.int64), np.zeros(4, np.int64), np.zeros(4, np.int64),
            np.array([4], np.int32), np.ones(1, np.int32)))


def test_plan_positions_wrap_past_int64_max_like_numpy(cpu_kernels):  # noqa: F811
    """prefix_len = INT64_MIN + 1 with a window of 3 starts the window at INT64_MAX - 1: the
    third entry's position wraps (the kernel computed it with a signed overflow, which the
    sanitizer run of the fuzz found)."""
    verify_plan, write_plan = kc.VerifyPlan.allocate(8), kc.WritePlan.allocate(1)
    with numpy_runs(Differential(cpu_kernels)):
        kc.plan(req_pool_indices=np.array([1]), prefix_lens=np.array([I64_MIN + 1]),
                extend_seq_lens=np.array([0]), req_to_token=np.arange(8).reshape(2, 4),
                verify_plan=verify_plan, write_plan=write_plan, swa_window_size=3,
                full_to_swa_index_mapping=np.arange(16))
    assert verify_plan.verify_expected_positions[:3].tolist() == [I64_MAX - 1, I64_MAX, I64_MIN]


def test_write_position_chain_wraps_past_int64_max_like_numpy(cpu_kernels):  # noqa: F811
    context = _small_context(4)
    context.canary_buf.view("<i8")[2, :4] = [7, I64_MAX, 0, 0]  # the seed's record
    plan = kc.WritePlan(np.array([0, 1]), np.array([2]), np.array([1], np.int32))
    with numpy_runs(Differential(cpu_kernels)):
        kc.write(context, plan, input_ids=np.array([5]), positions=np.array([0]),
                 out_cache_loc=np.array([3]))
    assert [v.expected_aux for v in context.violation_log.violations()] == [I64_MIN]
