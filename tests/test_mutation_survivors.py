"""Behaviours the mutation run (scripts/mutation.py) found unpinned: each test here kills
mutants that survived the rest of the suite."""

import pytest

from kvcanary.format.hashing import to_signed, to_unsigned


@pytest.mark.parametrize("bits, value", [
    (0, 0), ((1 << 63) - 1, (1 << 63) - 1), (1 << 63, -(1 << 63)), ((1 << 64) - 1, -1),
    (1 << 64, 0), (-1, -1)])
def test_to_signed_at_the_int64_edges(bits, value):
    assert to_signed(bits) == value
    assert to_unsigned(value) == bits & ((1 << 64) - 1)


# --------------------------------------------------------------- plan kernels beside the reference

import numpy as np  # noqa: E402

import kvcanary as kc  # noqa: E402
from kvcanary.format import consts  # noqa: E402
from builders import i64, linear_req_to_token  # noqa: E402
from kernel_harness.fixtures import cpu_kernels, kernels_behind_numpy  # noqa: E402,F401

MARK = consts.PLAN_SLOT_OUT_OF_TABLE


def _plan(rows, prefixes, table, **kwargs):
    verify_plan, write_plan = kc.VerifyPlan.allocate(64), kc.WritePlan.allocate(4)
    kc.plan(req_pool_indices=i64(rows), prefix_lens=i64(prefixes),
            extend_seq_lens=i64([1] * len(rows)), req_to_token=table, verify_plan=verify_plan,
            write_plan=write_plan, **kwargs)
    n = int(verify_plan.verify_num_valid[0])
    return verify_plan.verify_slot_indices[:n].tolist(), write_plan


def test_plan_row_one_past_the_table_is_out_of_table(kernels_behind_numpy):  # noqa: F811
    """Row index == number of rows: the first row outside (a `<=` bound would read past
    the table)."""
    slots, write_plan = _plan([4, 1], [2, 2], linear_req_to_token(4, 8))
    assert slots == [MARK, MARK, 8, 9]
    assert write_plan.write_seed_slot_indices[:2].tolist() == [MARK, 9]
    assert kernels_behind_numpy.compared == 1


def test_plan_translates_slot_zero_through_the_lut(kernels_behind_numpy):  # noqa: F811
    """Slot 0 is a slot like any other for the SWA table (only negatives pass through)."""
    table = linear_req_to_token(2, 8)
    table[1, :3] = [0, 5, -3]
    lut = np.arange(16, dtype=np.int64) + 100
    slots, write_plan = _plan([1], [3], table, swa_window_size=8, full_to_swa_index_mapping=lut)
    assert slots == [100, 105, -3]
    assert write_plan.write_seed_slot_indices[0] == -3
    assert kernels_behind_numpy.compared == 1


def test_write_to_the_slot_one_past_the_buffer_is_out_of_range(kernels_behind_numpy):  # noqa: F811
    from builders import make_context, make_write_plan, ring_rows

    ctx = make_context(num_slots=8)
    kc.write(ctx, make_write_plan([2], [-1]), input_ids=i64([5, 6]), positions=i64([0, 1]),
             out_cache_loc=i64([7, 8]))
    oor = int(kc.FailReason.SLOT_OUT_OF_RANGE)
    assert [(row[1], row[7]) for row in ring_rows(ctx)] == [(8, oor)]
    assert kernels_behind_numpy.compared == 1


def test_write_with_no_entries_in_total_writes_nothing(kernels_behind_numpy):  # noqa: F811
    """The early return reads the total at write_offsets[active]: a plan whose total is 0
    writes nothing, even when an earlier request's range looks non-empty."""
    from builders import counters, make_context

    ctx = make_context(num_slots=8)
    plan = kc.WritePlan.allocate(2)
    plan.write_offsets[:] = [0, 2, 0]
    plan.write_seed_slot_indices[:] = [-1, -1]
    plan.write_num_valid_reqs[0] = 2
    kc.write(ctx, plan, input_ids=i64([5, 6]), positions=i64([0, 1]), out_cache_loc=i64([1, 2]))
    assert not ctx.canary_buf.any()
    assert counters(ctx) == (0, 0, 1)
    assert kernels_behind_numpy.compared == 1


def test_position_assert_follows_each_seeded_request_of_a_launch(kernels_behind_numpy):  # noqa: F811
    """Two seeded requests of two entries each in one launch: every entry's expected
    position follows its own request's previous entry, not another request's seed."""
    from builders import make_context, make_write_plan, ring_rows

    ctx = make_context(num_slots=16, chain_position_assert=1)
    kc.write(ctx, make_write_plan([2, 2], [-1, -1]), input_ids=i64([1, 2, 3, 4]),
             positions=i64([0, 1, 0, 1]), out_cache_loc=i64([1, 2, 5, 6]))
    kc.write(ctx, make_write_plan([2, 2], [2, 6]), input_ids=i64([5, 6, 7, 8]),
             positions=i64([2, 3, 2, 3]), out_cache_loc=i64([3, 4, 7, 8]))
    assert ring_rows(ctx) == []
    kc.write(ctx, make_write_plan([2, 2], [4, 8]), input_ids=i64([9, 9, 9, 9]),
             positions=i64([4, 5, 4, 7]), out_cache_loc=i64([9, 10, 11, 12]))
    position = int(kc.FailReason.WRITE_POSITION_MISMATCH)
    assert [(row[1], row[7]) for row in ring_rows(ctx)] == [(12, position)]
    assert kernels_behind_numpy.compared == 3


# --------------------------------------------------------------- audit launches


def test_audit_launches_stay_within_chunk_entries(tmp_path):
    """Requests are grouped into launches of at most ``chunk_entries`` entries (a longer
    request in pieces of that many); progress reports the entries done after each launch."""
    from kvcanary.audit import audit
    from kvcanary.dump import load, save
    from test_request_boundaries import clean_batch_arrays  # lengths 4, 5, 0, 0, 3, 6

    dump = load(save(str(tmp_path / "d.npz"), **clean_batch_arrays()))
    for chunk_entries, launches in [(5, [4, 9, 12, 17, 18]), (9, [9, 18]), (8, [4, 12, 18]),
                                    (1, list(range(1, 19))), (100, [18])]:
        done = []
        result = audit(dump, backend="numpy", chunk_entries=chunk_entries,
                       progress=lambda d, total: done.append((d, total)))
        assert result.clean
        assert done == [(d, 18) for d in launches], chunk_entries


# --------------------------------------------------------------- dump keys that come in sets


@pytest.mark.parametrize("extra, key, text", [
    (dict(expected_tokens_valid_lens=np.array([4, 5, 0, 0, 3, 6], np.int64)),
     "expected_tokens", "missing"),
    (dict(sweep_slot_indices=np.array([1, 2], np.int64),
          sweep_prev_slot_indices=np.array([-1], np.int64),
          sweep_positions=np.array([0, 1], np.int64)),
     "sweep_prev_slot_indices", "shape"),
])
def test_dump_keys_of_one_set_are_checked_together(tmp_path, extra, key, text):
    """Valid lengths need their token pool; the three sweep arrays share one length."""
    from kvcanary.dump import DUMP_VERSION, VERSION_KEY, DumpError, load
    from test_request_boundaries import clean_batch_arrays

    path = str(tmp_path / "d.npz")
    np.savez(path, **{VERSION_KEY: np.int64(DUMP_VERSION)}, **clean_batch_arrays(), **extra)
    with pytest.raises(DumpError, match=f"key {key}: .*{text}"):
        load(path)


def test_dump_with_a_window_of_zero_loads_without_a_lut(tmp_path):
    """swa_window_size 0 is the no-window value, not a negative one."""
    from kvcanary.dump import load, save
    from test_request_boundaries import clean_batch_arrays

    dump = load(save(str(tmp_path / "d.npz"), **clean_batch_arrays(),
                     swa_window_size=np.int64(0)))
    assert dump.swa_window_size == 0 and dump.full_to_swa_index_mapping is None


def test_write_request_past_the_token_arrays_reads_nothing_beyond_them(kernels_behind_numpy):  # noqa: F811
    """A request whose range ends past the token arrays is reported and skipped by every
    write launch: the slots that happen to lie past out_cache_loc's end get no record and
    no real-KV hash. (The plan's offsets do not start at 0, a corrupt plan: kc.write refuses
    one as kc.plan makes it before any launch.)"""
    from builders import make_context, make_sources, ring_rows

    sources = make_sources(1, 16, fill="random")
    ctx = make_context(num_slots=16, sources=sources, mode=kc.RealKvHashMode.ALL)
    tokens = np.array([5, 6, 7, 8, 9], np.int64)
    slots = np.array([1, 2, 3, 4, 5], np.int64)  # only the first 3 are passed
    plan = kc.WritePlan(write_offsets=np.array([1, 5], np.int64),
                        write_seed_slot_indices=np.array([-1], np.int64),
                        write_num_valid_reqs=np.array([1], np.int32))
    kc.write(ctx, plan, input_ids=tokens[:3],
             positions=np.arange(3, dtype=np.int64), out_cache_loc=slots[:3])
    oor = int(kc.FailReason.SLOT_OUT_OF_RANGE)
    assert [(row[1], row[6], row[7]) for row in ring_rows(ctx)] == [(-1, 5, oor)]
    assert not ctx.canary_buf.any()
    assert kernels_behind_numpy.compared == 1
