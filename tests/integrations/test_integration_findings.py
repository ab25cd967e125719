"""The engine guards' findings (torch-free): ring rows attributed to plan entries by the
shared core also on shared slots, sightings merged per request, and the integrations
package importable without torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import Diagnosis, diagnose
from kvcanary.findings.causes import Cause
from kvcanary.integrations import findings as F
from test_import_isolation import BLOCKER


def _ctx(slots=16):
    return kc.CanaryContext(np.zeros((slots, 32), np.uint8), kernel_kind=kc.LaunchTag.TAIL_K_FULL,
                            violation_log=kc.ViolationLog.allocate(32),
                            slot_run_counter=np.zeros(1, np.int64),
                            kernel_run_counter=np.zeros(1, np.int64))


def _i64(v):
    return np.asarray(v, dtype=np.int64)


def _shared_slot_launch(table):
    """Request A (row 1) wrote tokens 5, 6, 7, 8 at slots 1..4; the plan verifies row 1's
    four positions and row 2's ``table`` (both read some of A's slots)."""
    ctx = _ctx()
    wp = kc.WritePlan.allocate(1)
    a = np.zeros((2, 4), np.int64)
    a[1] = [1, 2, 3, 4]
    kc.plan(req_pool_indices=_i64([1]), prefix_lens=_i64([0]), extend_seq_lens=_i64([4]),
            req_to_token=a, verify_plan=kc.VerifyPlan.allocate(1), write_plan=wp)
    kc.write(ctx, wp, input_ids=_i64([5, 6, 7, 8]), positions=_i64([0, 1, 2, 3]),
             out_cache_loc=_i64([1, 2, 3, 4]))
    both = np.zeros((3, 4), np.int64)
    both[1], both[2, :len(table)] = [1, 2, 3, 4], table
    plan = kc.VerifyPlan.allocate(8)
    kc.plan(req_pool_indices=_i64([1, 2]), prefix_lens=_i64([4, len(table)]),
            extend_seq_lens=_i64([0, 0]), req_to_token=both, verify_plan=plan,
            write_plan=kc.WritePlan.allocate(2))
    kc.verify(ctx, plan)
    return kc.attribute(ctx, plan, req_pool_indices=_i64([1, 2]),
                        prefix_lens=_i64([4, len(table)]), launch=3)


def test_a_row_on_a_shared_slot_goes_to_the_entry_that_fails():
    # Row 2 reads A's slot 2 (A's position 1) as its own chain head, position 0.
    found = _shared_slot_launch([2])
    assert [(f.entry.request_row, f.entry.position) for f in found] == [(2, 0)]
    assert found[0].launch == 3


def test_a_shared_slot_read_at_another_position_with_the_same_predecessor():
    # Row 2 maps positions 2, 3 to A's slots 2, 3: its entry at position 3 reads slot 3 after
    # slot 2, exactly as A's position 2 does (same token unknown, same expected chain link),
    # and only the position tells them apart: A passes, row 2 fails.
    found = _shared_slot_launch([11, 12, 2, 3])
    at_slot_3 = [f for f in found if f.violation.slot_idx == 3]
    assert [(f.entry.request_row, f.entry.position) for f in at_slot_3] == [(2, 3)]
    assert at_slot_3[0].violation.fail_reason_bits == int(kc.FailReason.VERIFY_POSITION_MISMATCH)


def _sighting(request_id, step, slot=7):
    row = kc.Violation(2, slot, 3, 1, 1, 0, 0, int(kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH))
    return F.Sighting(request_id, 3, slot, 0, ("verify_real_kv_hash",), row, step)


def test_sightings_merge_per_request_with_first_last_and_count():
    merger = kc.Merger(key=F.Sighting.key, kind=F.Finding)
    new = [merger.add([_sighting("req_1", step)]) for step in (4, 5, 9)]
    assert [len(n) for n in new] == [1, 0, 0]       # reported once, when first seen
    # Another request reading the same bad slot is a finding of its own.
    assert len(merger.add([_sighting("req_2", 9)])) == 1
    first, second = merger.findings
    assert (first.first_step, first.last_step, first.count) == (4, 9, 3)
    assert (second.request_id, second.count, second.slot, second.block) == ("req_2", 1, 7, 0)
    first.state(F.explain(first.finding, F.EngineEvidence("req_1", 3, 7, 7, sources="k0")))
    assert first.cause is Cause.KV_BYTES_CHANGED
    assert "changed after they were written" in first.explanation and "(k0)" in first.explanation
    record = first.to_dict()
    assert record["reasons"] == ["verify_real_kv_hash"]
    assert record["diagnosis"]["cause"] == "kv-bytes-changed"
    assert record["likely_cause"] == record["explanation"] == first.explanation
    text = first.describe()
    assert "steps 4..9 (3 times)" in text and f"  likely cause: {first.explanation}" in text


def test_an_index_outside_the_buffer_is_explained_by_the_shared_diagnosis():
    found = _shared_slot_launch([20])                 # the buffer has 16 slots
    assert [f.diagnosis.cause for f in found] == ["out-of-range"]
    sighting = F.Sighting("req_2", 0, 20, 2, ("slot_out_of_range",), found[0].violation, 3,
                          found[0].diagnosis)
    stated = F.explain(sighting, F.EngineEvidence("req_2", 0, 20, 20))
    assert stated == found[0].diagnosis and "outside the canary buffer" in stated.text


def test_integrations_import_without_torch():
    code = BLOCKER + ("import kvcanary.integrations, kvcanary.integrations.findings\n"
                      "import sys\n"
                      "assert not any(m.split('.')[0] in ('torch', 'transformers') "
                      "for m in sys.modules)\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def _every_engine_situation():
    """(sighting, evidence) pairs reaching every branch of the guards' explanation."""
    bits = kc.FailReason
    rows = {"position": int(bits.VERIFY_POSITION_MISMATCH),
            "chain": int(bits.VERIFY_CHAIN_HASH_MISMATCH),
            "kv": int(bits.VERIFY_REAL_KV_HASH_MISMATCH),
            "kv+position": int(bits.VERIFY_REAL_KV_HASH_MISMATCH | bits.VERIFY_POSITION_MISMATCH),
            "write": int(bits.WRITE_POSITION_MISMATCH)}
    history = Diagnosis.of(Cause.FREED_WHILE_HELD, block=1, step=2, request="a", then="")
    for name, b in rows.items():
        for stored in (3, 5):
            v = kc.Violation(2, 7, stored, 1, 1, 0, 0, b)
            for reasons in ((), (F.READ_INDEX_MISMATCH,), (F.WRITE_INDEX_MISMATCH,)):
                s = F.Sighting("a", 3, 7, 0, tuple(v.labels) + reasons, v, 4, diagnose(v))
                for writer in (None, ("a", 3, 1, True), ("b", 9, 2, True), ("b", 9, 2, False)):
                    for own in (None, 7, 8, 6, 2):
                        for extra in (dict(), dict(trash=True), dict(own_followed=False),
                                      dict(history=history), dict(moved="prefix at step 1"),
                                      dict(misread_before=True)):
                            yield s, F.EngineEvidence("a", 3, 7, 7, writer=writer, own_slot=own,
                                                      near_slots=(6, 8), engine_position=4,
                                                      sources="k0", **extra)


def test_every_cause_a_guard_finding_carries_is_a_member_of_the_vocabulary():
    stated = [F.explain(s, ev) for s, ev in _every_engine_situation()]
    assert all(isinstance(d, Diagnosis) and d.cause in Cause and d.text for d in stated)
    causes = {d.cause for d in stated}
    assert {Cause.MISREAD, Cause.OFFSET_SHIFTED, Cause.LOST_WRITE, Cause.MISDIRECTED_WRITE,
            Cause.REMAPPED, Cause.FREED_WHILE_HELD, Cause.OVERWRITTEN, Cause.KV_BYTES_CHANGED,
            Cause.CHANGED_AFTER_MOVE, Cause.WRITE_INPUT, Cause.NEVER_WRITTEN} <= causes, causes
    # A finding takes its cause only as a Diagnosis (whose cause is always a member).
    merger = kc.Merger(key=F.Sighting.key, kind=F.Finding)
    found, = merger.add([_sighting("req_1", 1)])
    with pytest.raises(TypeError, match="a finding's cause is a kvcanary.Diagnosis"):
        found.state("the slot went bad somehow")
    with pytest.raises(AttributeError):
        found.explanation = "the slot went bad somehow"
    with pytest.raises(ValueError, match="not a valid Cause"):
        found.state(Diagnosis("went-bad", "the slot went bad somehow"))
    assert found.cause is None and found.explanation == ""
    found.state(stated[0], "sliding_attention group: ")
    assert found.explanation == "sliding_attention group: " + stated[0].text
