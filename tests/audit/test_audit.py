"""The audit library on hand-built dumps: what it checks, how it attributes rows, overflow,
extensions and errors."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.audit import AuditError, audit, likely_cause
from kvcanary.backends.resolve import cupy_unavailable
from kvcanary.format.consts import PLAN_SLOT_OUT_OF_TABLE, FailReason
from kvcanary.dump import load, save

TOKENS = {1: [11, 12, 13, 14, 15, 16], 2: [11, 12, 13, 24, 25], 3: [31, 32, 33, 34]}
# Rows 1 and 2 share the prefix slots of positions 0..2 (a radix-cached prefix).
SLOTS = {1: [5, 6, 7, 8, 9, 10], 2: [5, 6, 7, 20, 21], 3: [30, 31, 32, 33]}


def build(num_slots=40, *, expected=True, sources=1):
    """Three requests written through plan + write, as a server would, then dumped."""
    canary = np.zeros((num_slots, 32), np.uint8)
    rng = np.random.default_rng(0)
    kv = rng.integers(0, 255, size=(num_slots, 32), dtype=np.uint8)
    context = kc.CanaryContext(
        canary, kernel_kind=kc.LaunchTag.TAIL_K_FULL, violation_log=kc.ViolationLog.allocate(8),
        slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64),
        real_kv_sources=tuple(kc.RealKvSource(kv, page_size=1, num_bytes_per_token=32,
                                              read_bytes=32) for _ in range(sources)),
        real_kv_hash_mode=kc.RealKvHashMode.ALL, max_real_kv_sources=max(4, sources))
    table = np.zeros((4, 8), np.int32)
    pool = np.zeros((4, 8), np.int32)
    for row in (1, 3, 2):   # row 2 reuses row 1's cached prefix: it writes only its suffix
        table[row, :len(SLOTS[row])] = SLOTS[row]
        pool[row, :len(TOKENS[row])] = TOKENS[row]
        prefix = 3 if row == 2 else 0
        n = len(SLOTS[row]) - prefix
        vp, wp = kc.VerifyPlan.allocate(16), kc.WritePlan.allocate(1)
        kc.plan(req_pool_indices=np.array([row]), prefix_lens=np.array([prefix]),
                extend_seq_lens=np.array([n]), req_to_token=table, verify_plan=vp, write_plan=wp)
        kc.write(context, wp, input_ids=np.array(TOKENS[row][prefix:], np.int64),
                 positions=np.arange(prefix, prefix + n, dtype=np.int64),
                 out_cache_loc=np.array(SLOTS[row][prefix:], np.int64))
    assert context.violation_log.total == 0
    arrays = dict(canary=canary, req_to_token=table,
                  req_pool_indices=np.array([1, 0, 2, 3], np.int64),
                  seq_lens=np.array([6, 0, 5, 4], np.int64))
    if sources:
        arrays.update({f"real_kv_{i}": kv for i in range(sources)})
        arrays.update(real_kv_params=np.array([[1, 32, 32]] * sources), real_kv_hash_mode="all")
    if expected:
        arrays.update(expected_tokens=pool,
                      expected_tokens_valid_lens=np.array([6, 0, 5, 4], np.int64))
    return arrays


def fields(arrays):
    return arrays["canary"].view("<i8")[:, :4]


def run(tmp_path, arrays, name="d.npz", **options):
    return audit(load(save(str(tmp_path / name), **arrays)), backend="numpy", **options)


def test_clean_dump_checks_every_live_entry(tmp_path):
    result = run(tmp_path, build())
    assert result.clean and result.findings == []
    assert result.live_entries == 6 + 5 + 4 and result.entries_checked == 15
    assert result.live_requests == 3 and result.check_expected_token


def test_position_fault_is_attributed_with_a_cause(tmp_path):
    arrays = build()
    fields(arrays)[32, 1] = 9   # row 3, position 2
    result = run(tmp_path, arrays)
    assert result.total_violations == 2   # the slot itself and its successor's chain link
    first, second = result.findings
    assert (first.request_row, first.batch_index, first.position) == (3, 3, 2)
    assert first.violation.fail_reason_bits == FailReason.VERIFY_POSITION_MISMATCH
    assert first.checks == ("stored position",)
    assert first.diagnosis.cause == "position-changed"
    assert "written as position 2, but it now says position 9" in first.cause
    assert (second.request_row, second.position, second.prev_slot) == (3, 3, 32)
    assert second.violation.fail_reason_bits == FailReason.VERIFY_CHAIN_HASH_MISMATCH
    assert second.diagnosis.cause == "predecessor-changed"
    assert "predecessor slot 32 (position 2) has a finding" in second.cause
    assert first.violation.log_line().startswith("kv_canary violation: launch_tag=TAIL_K_FULL "
                                                 "fail_reason=verify_position slot_idx=32")


def test_shared_slot_fault_is_attributed_to_every_request_that_maps_it(tmp_path):
    arrays = build()
    arrays["real_kv_0"][6, 0] ^= 1     # slot 6: position 1 of rows 1 and 2
    result = run(tmp_path, arrays)
    assert result.unattributed == 0
    where = sorted((f.request_row, f.position) for f in result.findings)
    assert where == [(1, 1), (2, 1)]
    assert all(f.violation.fail_reason_bits == FailReason.VERIFY_REAL_KV_HASH_MISMATCH
               for f in result.findings)
    assert "real KV bytes of slot 6 in the K cache of the FULL group" in result.findings[0].cause


def test_token_check_needs_expected_tokens(tmp_path):
    arrays = build(expected=False)
    fields(arrays)[10, 0] = 99   # last token of row 1: no successor to break
    assert run(tmp_path, arrays).clean
    arrays = build()
    fields(arrays)[10, 0] = 99
    result = run(tmp_path, arrays, "e.npz")
    assert [f.violation.fail_reason_bits for f in result.findings] == [FailReason.VERIFY_TOKEN_MISMATCH]
    assert "token 99 where the request's history has 16" in result.findings[0].cause


def test_table_entry_outside_the_buffer_is_a_finding(tmp_path):
    arrays = build()
    arrays["req_to_token"][3, 1] = 1000
    result = run(tmp_path, arrays)
    bits = {(f.request_row, f.position): f.violation.fail_reason_bits for f in result.findings}
    assert bits[(3, 1)] == FailReason.SLOT_OUT_OF_RANGE
    assert bits[(3, 2)] & FailReason.SLOT_OUT_OF_RANGE   # its predecessor is out too
    assert "outside the canary buffer (slot 1000" in result.findings[0].cause


def test_prefix_beyond_the_table_is_a_finding(tmp_path):
    arrays = build()
    arrays["seq_lens"][3] = 9       # the table has 8 columns
    arrays["expected_tokens_valid_lens"][3] = 9
    result = run(tmp_path, arrays)
    outside = [f for f in result.findings if f.violation.slot_idx == PLAN_SLOT_OUT_OF_TABLE]
    assert [f.position for f in outside] == [8]
    assert "lies outside req_to_token" in outside[0].cause


def test_slot_zero_extension_and_compat(tmp_path):
    arrays = build()
    arrays["req_to_token"][1, 4] = 0
    strict = run(tmp_path, arrays)
    assert [(f.request_row, f.position, f.violation.fail_reason_bits) for f in strict.findings] \
        == [(1, 4, FailReason.SLOT_ZERO_IN_PREFIX)]
    assert "padding slot 0" in strict.findings[0].cause
    assert run(tmp_path, arrays, "c.npz", compat=True).clean


def test_overflow_is_reported_not_silent(tmp_path):
    arrays = build()
    fields(arrays)[:, 1] += 100     # every record at the wrong position
    full = run(tmp_path, arrays)
    small = run(tmp_path, arrays, "s.npz", ring_capacity=3)
    assert full.total_violations == small.total_violations == 15
    assert not full.ring_overflow and full.dropped == 0
    assert small.ring_overflow and small.dropped == 12 and len(small.findings) == 3
    assert small.counts_by_reason == full.counts_by_reason
    assert small.counts_by_tag == {"TAIL_K_FULL": 15}
    assert small.summary_record()["dropped"] == 12


def test_chunking_does_not_change_the_result(tmp_path):
    arrays = build()
    fields(arrays)[7, 2] ^= 1
    fields(arrays)[31, 1] = 0
    one = run(tmp_path, arrays)
    many = run(tmp_path, arrays, "m.npz", chunk_entries=2)
    assert [f.to_dict() for f in one.findings] == [f.to_dict() for f in many.findings]


def test_sweep_entries_use_the_sweep_tag(tmp_path):
    arrays = build()
    arrays.update(sweep_slot_indices=np.array([5, 6, 7, 8], np.int64),
                  sweep_prev_slot_indices=np.array([-1, 5, 6, 7], np.int64),
                  sweep_positions=np.array([0, 1, 2, 4], np.int64))
    result = run(tmp_path, arrays)
    assert result.sweep_entries == 4 and result.entries_checked == 19
    (finding,) = result.findings
    assert finding.kind == "sweep" and finding.sweep_index == 3
    assert finding.violation.launch_tag == "SWEEP_K_FULL"


def test_zero_entries_is_an_error(tmp_path):
    arrays = build()
    arrays["seq_lens"][:] = 0
    with pytest.raises(AuditError, match="nothing to check"):
        run(tmp_path, arrays)
    arrays = build()
    arrays["req_pool_indices"][:] = 0
    with pytest.raises(AuditError, match="zero entries proves nothing"):
        run(tmp_path, arrays, "z.npz")


def test_source_bound_is_enforced(tmp_path):
    arrays = build(sources=5)
    with pytest.raises(ValueError, match="at most 4 RealKvSource entries"):
        run(tmp_path, arrays)
    assert run(tmp_path, arrays, "b.npz", max_real_kv_sources=5).clean


def test_a_backend_that_cannot_run_is_an_audit_error(tmp_path):
    dump = load(save(str(tmp_path / "d.npz"), **build()))
    with pytest.raises(AuditError, match=r"^backend must be one of auto, numpy, cupy, got 'tpu'$"):
        audit(dump, backend="tpu")
    assert audit(dump, backend="auto").backend == ("numpy" if cupy_unavailable() else "cupy")
    if cupy_unavailable():
        with pytest.raises(AuditError, match="^backend cupy is not usable: "):
            audit(dump, backend="cupy")


def test_likely_cause_of_a_broken_chain_head():
    v = kc.Violation(2, 5, 0, 1, -1, 0, 0, int(FailReason.VERIFY_CHAIN_HASH_MISMATCH))
    assert "chain head" in likely_cause(v, position=0, prev_slot=-1, num_slots=8)


def test_likely_cause_of_a_slot_outside_a_real_kv_source():
    v = kc.Violation(2, 5, 0, 1, -1, 0, 5, int(FailReason.SLOT_OUT_OF_RANGE))
    assert "past the rows of a real-KV source" in likely_cause(v, position=0, prev_slot=-1,
                                                               num_slots=8)


def test_a_real_kv_source_smaller_than_the_buffer_reports_the_slots_past_it(tmp_path):
    arrays = build()
    arrays["real_kv_0"] = arrays["real_kv_0"][:24]  # row 3's slots 30..33 lie past it
    result = run(tmp_path, arrays)
    assert sorted(f.violation.slot_idx for f in result.findings) == [30, 31, 32, 33]
    for f in result.findings:
        assert f.violation.fail_reason_bits == int(FailReason.SLOT_OUT_OF_RANGE)
        assert f.request_row == 3 and "past the rows of a real-KV source" in f.cause


def test_sweep_chunks_keep_indices(tmp_path):
    arrays = build()
    arrays.update(sweep_slot_indices=np.array([5, 6, 7, 8, 9, 10], np.int64),
                  sweep_prev_slot_indices=np.array([-1, 5, 6, 7, 8, 9], np.int64),
                  sweep_positions=np.array([0, 1, 2, 3, 4, 6], np.int64))
    one = run(tmp_path, arrays)
    many = run(tmp_path, arrays, "m.npz", chunk_entries=4)
    assert [f.sweep_index for f in one.findings] == [f.sweep_index for f in many.findings] == [5]


def test_row_matching_keeps_order_among_identical_rows():
    from kvcanary.audit.matching import _match_rows

    a, b, c = [2, 5, 1, 0, 0, 0, 0, 2], [2, 6, 1, 0, 0, 0, 0, 2], [2, 7, 0, 0, 0, 0, 0, 1]
    rows = np.array([b, a, a, c], dtype=np.int64)          # ring order (e.g. a GPU's)
    predicted = np.array([a, b, a], dtype=np.int64)
    entries = np.array([9, 4, 3], dtype=np.int64)          # a predicted by entries 3 and 9
    np.testing.assert_array_equal(_match_rows(rows, predicted, entries), [4, 3, 9, -1])
