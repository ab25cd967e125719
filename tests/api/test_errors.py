"""Argument errors (docs/format.md §13) that apply to this API, with upstream's texts (numpy dtype
names), plus the source-count bound (docs/format.md §5)."""

import re

import numpy as np
import pytest

import kvcanary as kc
from builders import (i64, linear_req_to_token, make_context, make_sources, make_verify_plan,
                      make_write_plan, write_tokens)


def raises(text):
    return pytest.raises(ValueError, match=re.escape(text))


# ------------------------------------------------------------------ RealKvSource, in order

def test_source_page_size():
    with raises("kv-canary: RealKvSource.page_size must be >= 1, got 0"):
        kc.RealKvSource(np.zeros((4, 16), np.uint8), page_size=0, num_bytes_per_token=16,
                        read_bytes=16)


@pytest.mark.parametrize("n", [0, -16, 24])
def test_source_num_bytes_per_token(n):
    with raises(f"kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of "
                f"16, got {n}"):
        kc.RealKvSource(np.zeros((4, 16), np.uint8), page_size=1, num_bytes_per_token=n,
                        read_bytes=16)


@pytest.mark.parametrize("r", [0, 48, 8])
def test_source_read_bytes(r):
    with raises("kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in "
                f"(0, num_bytes_per_token=32], got {r}"):
        kc.RealKvSource(np.zeros((4, 32), np.uint8), page_size=1, num_bytes_per_token=32,
                        read_bytes=r)


def test_source_checks_run_in_order():
    # page_size is reported before the (also bad) byte counts and shape
    with raises("page_size must be >= 1"):
        kc.RealKvSource(np.zeros(4, np.uint8), page_size=0, num_bytes_per_token=3, read_bytes=0)
    with raises("num_bytes_per_token must be"):
        kc.RealKvSource(np.zeros(4, np.uint8), page_size=1, num_bytes_per_token=3, read_bytes=0)
    with raises("read_bytes must be"):
        kc.RealKvSource(np.zeros(4, np.uint8), page_size=1, num_bytes_per_token=16, read_bytes=0)


def test_source_ndim():
    with raises("kv-canary: RealKvSource.tensor must be at least 2-D, got shape (64,)"):
        kc.RealKvSource(np.zeros(64, np.uint8), page_size=1, num_bytes_per_token=16,
                        read_bytes=16)


def test_source_row_stride():
    backing = np.zeros((4, 40), np.uint8)
    view = backing[:, :32]
    with raises("kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, got "
                "40 bytes (shape=(4, 32), strides=(40, 1), dtype=uint8)"):
        kc.RealKvSource(view, page_size=1, num_bytes_per_token=16, read_bytes=16)


def test_source_row_stride_uses_element_size():
    backing = np.zeros((4, 10), np.float32)  # 40-byte rows
    with raises("got 40 bytes (shape=(4, 10), strides=(40, 4), dtype=float32)"):
        kc.RealKvSource(backing, page_size=1, num_bytes_per_token=16, read_bytes=16)


# ------------------------------------------------------------------ allocations

def test_allocations():
    with raises("kv-canary: VerifyPlan verify_capacity must be positive, got 0"):
        kc.VerifyPlan.allocate(0)
    with raises("kv-canary: WritePlan write_req_capacity must be positive, got -1"):
        kc.WritePlan.allocate(-1)
    with raises("kv-canary: ViolationLog ring_capacity must be positive, got 0"):
        kc.ViolationLog.allocate(0)


# ------------------------------------------------------------------ source-count bound

def _plans():
    return make_verify_plan([1], [0], [-1]), make_write_plan([1], [-1])


def _launch_both(ctx):
    vp, wp = _plans()
    kc.write(ctx, wp, input_ids=i64([1]), positions=i64([0]), out_cache_loc=i64([1]))
    kc.verify(ctx, vp)


@pytest.mark.parametrize("launch", ["verify", "write"])
def test_five_sources_rejected_at_default_bound(launch):
    ctx = make_context(sources=make_sources(5, 32), mode=kc.RealKvHashMode.ALL)
    vp, wp = _plans()
    with raises("kv-canary: at most 4 RealKvSource entries supported by the CUDA ABI, got 5"):
        if launch == "verify":
            kc.verify(ctx, vp)
        else:
            kc.write(ctx, wp, input_ids=i64([1]), positions=i64([0]), out_cache_loc=i64([1]))
    assert int(ctx.kernel_run_counter[0]) == 0  # raised before any launch


def test_bound_message_first_line_is_upstreams():
    ctx = make_context(sources=make_sources(5, 32))
    with pytest.raises(ValueError) as info:
        kc.verify(ctx, _plans()[0])
    assert str(info.value).splitlines()[0] == (
        "kv-canary: at most 4 RealKvSource entries supported by the CUDA ABI, got 5")


def test_bound_of_eight():
    ctx = make_context(sources=make_sources(9, 32), mode=kc.RealKvHashMode.ALL,
                       max_real_kv_sources=8)
    with raises("kv-canary: at most 8 RealKvSource entries supported by the CUDA ABI, got 9"):
        _launch_both(ctx)
    ctx = make_context(sources=make_sources(8, 32), mode=kc.RealKvHashMode.ALL,
                       max_real_kv_sources=8)
    _launch_both(ctx)
    assert int(ctx.violation_log.write_index[0]) == 0
    assert int(ctx.kernel_run_counter[0]) == 2


def test_four_sources_pass_at_default_bound():
    _launch_both(make_context(sources=make_sources(4, 32), mode=kc.RealKvHashMode.PARTIAL))


@pytest.mark.parametrize("launch", ["verify", "write"])
def test_a_launch_checks_the_source_count_once(launch, monkeypatch):
    from kvcanary.model import types as T

    calls = []
    monkeypatch.setattr(T, "check_source_count", lambda *a, **k: calls.append(a))
    ctx = make_context(sources=make_sources(2, 32), mode=kc.RealKvHashMode.ALL)
    vp, wp = _plans()
    if launch == "verify":
        kc.verify(ctx, vp)
    else:
        kc.write(ctx, wp, input_ids=i64([1]), positions=i64([0]), out_cache_loc=i64([1]))
    assert calls == [(2, kc.MAX_REAL_KV_SOURCES)]


def test_context_arrays_are_listed_once():
    """The disjointness check and the library come from the one list of a context's arrays."""
    from kvcanary.model.arrays import context_arrays

    ctx = make_context(sources=make_sources(1, 32))
    names = list(context_arrays(ctx))
    assert names[0] == "canary_buf" and names[-1] == "real_kv_sources[0].tensor"
    assert list(context_arrays(ctx, sources=False)) == names[:-1]
    ctx.slot_run_counter = ctx.kernel_run_counter     # two counters, one array
    with raises("kv-canary: kernel_run_counter and slot_run_counter share memory"):
        kc.verify(ctx, _plans()[0])


# ------------------------------------------------------------------ launch context

def test_source_must_be_2d():
    # One rule for a source's dimensions, checked when the source is built.
    with raises("kv-canary: RealKvSource.tensor (viewed as uint8) must be 2-D, got 3-D"):
        kc.RealKvSource(np.zeros((32, 2, 16), np.uint8), page_size=1, num_bytes_per_token=16,
                        read_bytes=16)


def test_slot_stride_too_small():
    ctx = make_context(canary=np.zeros((8, 24), np.uint8))
    with raises("kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got 3"):
        kc.verify(ctx, _plans()[0])
    with raises("kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got 3"):
        write_tokens(ctx, [1], [1], [0])


def test_row_too_narrow_only_when_hashing():
    src = kc.RealKvSource(np.zeros((32, 16), np.uint8), page_size=2, num_bytes_per_token=16,
                          read_bytes=16)
    text = ("kv-canary: RealKvSource row is too narrow for its slot layout: dim-1 is 16 bytes "
            "but page_size=2 x num_bytes_per_token=16 needs 32")
    for mode in (kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.ALL):
        with raises(text):
            kc.verify(make_context(sources=[src], mode=mode), _plans()[0])
        with raises(text):
            write_tokens(make_context(sources=[src], mode=mode), [1], [1], [0])
    kc.verify(make_context(sources=[src], mode=kc.RealKvHashMode.NONE), _plans()[0])


@pytest.mark.parametrize("name", ["canary_buf", "input_ids", "positions", "out_cache_loc"])
def test_write_contiguity(name):
    canary = np.zeros((8, 64), np.uint8)[:, :32] if name == "canary_buf" else None
    ctx = make_context(num_slots=8, canary=canary)
    arrays = {"input_ids": i64([1, 2]), "positions": i64([0, 1]), "out_cache_loc": i64([1, 2])}
    if name != "canary_buf":
        arrays[name] = np.repeat(arrays[name], 2)[::2]
    with raises(f"kv-canary: {name} must be contiguous"):
        kc.write(ctx, make_write_plan([2], [-1]), **arrays)


@pytest.mark.parametrize("field", kc.VerifyPlan.FIELDS)
def test_verify_plan_contiguity(field):
    plan = make_verify_plan([1, 2], [0, 1], [-1, 1])
    setattr(plan, field, np.repeat(getattr(plan, field), 2)[::2])
    with raises(f"kv-canary: plan.{field} must be contiguous"):
        kc.verify(make_context(), plan)


def test_expected_inputs_presence():
    ctx = make_context()
    text = "kv-canary: expected input tensors are required when enable_write_input_assert=True"
    with raises(text):
        kc.write(ctx, make_write_plan([1], [-1]), input_ids=i64([1]), positions=i64([0]),
                 out_cache_loc=i64([1]), expected_input_tokens=i64([1]))
    with raises(text):
        kc.write(ctx, make_write_plan([1], [-1]), input_ids=i64([1]), positions=i64([0]),
                 out_cache_loc=i64([1]), expected_input_positions=i64([0]))


def test_token_array_dtype_and_length():
    ctx = make_context()
    with raises("kv-canary: input_ids must have dtype int64, got int32"):
        kc.write(ctx, make_write_plan([1], [-1]), input_ids=np.array([1], np.int32),
                 positions=i64([0]), out_cache_loc=i64([1]))
    with raises("kv-canary: out_cache_loc length must be 1, got 2"):
        kc.write(ctx, make_write_plan([1], [-1]), input_ids=i64([1]), positions=i64([0]),
                 out_cache_loc=i64([1, 2]))


def test_write_offsets_length():
    plan = kc.WritePlan(write_offsets=i64([0, 1]), write_seed_slot_indices=i64([-1, -1]),
                        write_num_valid_reqs=np.ones(1, np.int32))
    with raises("kv-canary: write_offsets_len must equal write_req_capacity + 1, got 2 and 3"):
        kc.write(make_context(), plan, input_ids=i64([1]), positions=i64([0]),
                 out_cache_loc=i64([1]))


def test_plan_num_valid_dtype():
    plan = make_verify_plan([1], [0], [-1])
    plan.verify_num_valid = np.ones(1, np.int64)
    with raises("kv-canary: plan.verify_num_valid must have dtype int32, got int64"):
        kc.verify(make_context(), plan)


# ------------------------------------------------------------------ plan

def _plan(**overrides):
    args = dict(req_pool_indices=i64([1]), prefix_lens=i64([2]), extend_seq_lens=i64([1]),
                req_to_token=linear_req_to_token(2, 8), verify_plan=kc.VerifyPlan.allocate(8),
                write_plan=kc.WritePlan.allocate(2))
    args.update(overrides)
    kc.plan(**args)


def test_plan_requires_lut_with_window():
    with raises("kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping when "
                "swa_window_size > 0"):
        _plan(swa_window_size=4)


def test_plan_swa_slot_outside_lut():
    with raises("kv-canary: SWA slot 8 is outside full_to_swa_index_mapping length 8"):
        _plan(req_pool_indices=i64([1]), prefix_lens=i64([3]), swa_window_size=4,
              full_to_swa_index_mapping=np.arange(8, dtype=np.int64))


def test_plan_valid_lens_required_with_pool():
    # upstream has two texts for this rule (plan reference / entries kernel); both end so
    with pytest.raises(ValueError, match=r"^kv-canary: launch_\w+ requires " + re.escape(
            "req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set")):
        _plan(req_to_verify_expected_tokens=np.zeros((2, 8), np.int32))


def test_plan_dtypes_shapes_lengths():
    with raises("kv-canary: prefix_lens must have dtype int64, got int32"):
        _plan(prefix_lens=np.array([2], np.int32))
    with raises("kv-canary: req_to_token must have dtype int32 or int64, got float32"):
        _plan(req_to_token=np.zeros((2, 8), np.float32))
    with raises("kv-canary: req_to_token must be 2-D, got shape (16,)"):
        _plan(req_to_token=np.zeros(16, np.int32))
    with raises("kv-canary: req_pool_indices must be 1-D, got shape (1, 1)"):
        _plan(req_pool_indices=np.ones((1, 1), np.int64))
    with raises("kv-canary: extend_seq_lens length must be 1, got 2"):
        _plan(extend_seq_lens=i64([1, 1]))
    with raises("kv-canary: req_to_token must be contiguous"):
        _plan(req_to_token=linear_req_to_token(2, 16)[:, ::2])


def test_plan_bs_exceeds_write_capacity():
    with raises("kv-canary: bs=3 exceeds write_req_capacity=2"):
        _plan(req_pool_indices=i64([1, 1, 1]), prefix_lens=i64([1, 1, 1]),
              extend_seq_lens=i64([1, 1, 1]))


def test_unknown_backend():
    with raises("kv-canary: backend must be one of auto, numpy, cupy, got 'torch'"):
        kc.verify(make_context(), make_verify_plan([1], [0], [-1]), backend="torch")


# ------------------------------------------------------------------ the error type

def test_error_carries_detail_and_key():
    with pytest.raises(kc.CanaryError) as caught:
        kc.RealKvSource(np.zeros((4, 64), np.uint8), page_size=0, num_bytes_per_token=16,
                        read_bytes=16)
    err = caught.value
    assert err.detail == "RealKvSource.page_size must be >= 1, got 0"
    assert err.key == "page_size"
    assert str(err) == "kv-canary: " + err.detail
    assert isinstance(err, ValueError)


def test_error_names_the_array():
    with pytest.raises(kc.CanaryError) as caught:
        kc.VerifyPlan.allocate(0)
    assert caught.value.key == "verify_capacity"
    from kvcanary.model.arrays import check_int64

    with pytest.raises(TypeError) as wrong_kind:   # still a TypeError where it was one
        check_int64("3", "block_size")
    assert isinstance(wrong_kind.value, kc.CanaryError)
    assert wrong_kind.value.key == "block_size"


def test_error_survives_pickling():
    import pickle

    from kvcanary.dump import DumpError

    for err in (kc.CanaryError("x must be positive", key="x"), DumpError("a.npz: key k: bad")):
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), str(back), back.detail, back.key) == \
               (type(err), str(err), err.detail, err.key)


def test_tool_errors_have_no_prefix():
    from kvcanary.dump import DumpError
    from kvcanary.audit.explain import ExplainError

    for cls in (DumpError, ExplainError):
        err = cls("run.npz: key seq_lens: missing")
        assert isinstance(err, kc.CanaryError)
        assert str(err) == err.detail == "run.npz: key seq_lens: missing"


def test_cli_prints_the_detail():
    from kvcanary.cli.common import user_error
    from kvcanary.backends.cuda import CudaUnavailable

    assert user_error(kc.CanaryError("bs=9 exceeds write_req_capacity=8")) == \
        "bs=9 exceeds write_req_capacity=8"
    assert user_error(CudaUnavailable("cupy sees no CUDA device")) == "cupy sees no CUDA device"
