"""Property tests: clean runs stay clean, any single corruption is reported with the
right bit (hypothesis, derandomized)."""

from hypothesis import HealthCheck, given, settings, strategies as st

import kvcanary as kc
from builders import fields, ring_rows, source_slot_bytes
from workload import Request, Workload, run_workload

CHAIN, POSITION, REAL_KV, TOKEN = 1, 2, 4, 32
PROFILE = settings(derandomize=True, deadline=None, max_examples=150,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def workloads(draw, min_sources=0):
    n = draw(st.integers(1, 4))
    donor = Request(draw(st.integers(1, 20)), draw(st.integers(0, 6)), draw(st.integers(1, 8)))
    requests = [donor]
    for _ in range(n - 1):
        prompt = draw(st.integers(1, 20))
        share = draw(st.integers(0, min(prompt - 1, donor.prompt_len)))
        requests.append(Request(prompt, draw(st.integers(0, 6)), draw(st.integers(1, 8)), share))
    num_sources = draw(st.integers(min_sources, 4))
    bytes_per_token = draw(st.sampled_from([16, 32, 64]))
    return Workload(
        requests=requests,
        page_size=draw(st.sampled_from([1, 4, 16])),
        num_sources=num_sources,
        mode=draw(st.sampled_from(list(kc.RealKvHashMode))),
        bytes_per_token=bytes_per_token,
        read_bytes=draw(st.sampled_from([r for r in (16, 32, 64) if r <= bytes_per_token])),
        row_gap=draw(st.sampled_from([0, 16])),
        seed=draw(st.integers(0, 2**16)),
        swa_window=draw(st.sampled_from([0, 0, 3, 8])),
    )


@PROFILE
@given(workloads())
def test_write_then_verify_is_always_clean(workload):
    run = run_workload(workload)
    assert run.dirty == [], ring_rows(run.ctx)
    plan = run.final_plan
    n = int(plan.verify_num_valid[0])
    window = workload.swa_window
    assert n == sum(min(length, window) if window else length for length in run.lengths)
    assert int(run.ctx.kernel_run_counter[0]) == 2 * run.steps + 1


def _expected_rows(plan, target, bits_at_slot, bits_at_successor):
    n = int(plan.verify_num_valid[0])
    rows = []
    for e in range(n):
        slot = int(plan.verify_slot_indices[e])
        bits = (bits_at_slot if slot == target else 0) | \
            (bits_at_successor if int(plan.verify_prev_slot_indices[e]) == target else 0)
        if bits:
            rows.append((slot, bits))
    return rows


def _observed(ctx, plan, check_token):
    ctx.violation_log.clear()
    kc.verify(ctx, plan, check_expected_token=check_token)
    return [(r[1], r[7]) for r in ring_rows(ctx)]


def _corruption_target(workload, pick):
    run = run_workload(workload)
    assert run.dirty == []
    plan = run.final_plan
    n = int(plan.verify_num_valid[0])
    return run.ctx, plan, int(plan.verify_slot_indices[pick % n])


@PROFILE
@given(workloads(), st.sampled_from(["token", "position", "prev_hash"]),
       st.integers(0, 10**6), st.integers(1, 2**40))
def test_single_corruption_is_reported_with_the_right_bit(workload, kind, pick, delta):
    ctx, plan, target = _corruption_target(workload, pick)
    record = fields(ctx.canary_buf)[target]
    if kind == "token":
        record[0] += delta
        assert _observed(ctx, plan, False) == _expected_rows(plan, target, 0, CHAIN)
        assert _observed(ctx, plan, True) == _expected_rows(plan, target, TOKEN, CHAIN)
    elif kind == "position":
        record[1] -= delta
        assert _observed(ctx, plan, True) == _expected_rows(plan, target, POSITION, CHAIN)
    else:
        record[2] ^= delta
        assert _observed(ctx, plan, True) == _expected_rows(plan, target, CHAIN, CHAIN)


@PROFILE
@given(workloads(min_sources=1), st.integers(0, 10**6), st.integers(1, 2**40))
def test_single_real_kv_corruption_is_reported_with_the_right_bit(workload, pick, delta):
    """A changed byte inside the hashed range is a real-KV mismatch at that slot only; a
    byte outside it (past the read width, or any byte with mode NONE) changes nothing."""
    ctx, plan, target = _corruption_target(workload, pick)
    sources = ctx.real_kv_sources
    source = sources[pick % len(sources)]
    width = source.effective_read_bytes(ctx.real_kv_hash_mode)
    data = source_slot_bytes(source, target)
    if width < data.size:
        data[width + (pick % (data.size - width))] ^= 0x5A
        assert _observed(ctx, plan, True) == []
    if width:
        data[pick % width] ^= 1 + (delta % 255)
        assert _observed(ctx, plan, True) == _expected_rows(plan, target, REAL_KV, 0)
