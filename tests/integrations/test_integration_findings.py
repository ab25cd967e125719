"""The engine guards' shared findings logic (torch-free): ring rows attributed to plan
entries also on shared slots, repeats merged, and the integrations package importable
without torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

import kvcanary as kc
from kvcanary.integrations import findings as F
from test_import_isolation import BLOCKER


def _ctx(slots=16):
    return kc.CanaryContext(np.zeros((slots, 32), np.uint8), kernel_kind=kc.LaunchTag.TAIL_K_FULL,
                            violation_log=kc.ViolationLog.allocate(32),
                            slot_run_counter=np.zeros(1, np.int64),
                            kernel_run_counter=np.zeros(1, np.int64))


def _i64(v):
    return np.asarray(v, dtype=np.int64)


def test_rows_on_a_shared_slot_go_to_the_entry_that_fails():
    ctx = _ctx()
    # Request A wrote tokens 5, 6 at slots 4, 5; request B's table maps its position 0 to
    # slot 5 as well (shared), where B expects token 9 at position 0.
    wp = kc.WritePlan.allocate(1)
    kc.plan(req_pool_indices=_i64([1]), prefix_lens=_i64([0]), extend_seq_lens=_i64([2]),
            req_to_token=np.array([[0, 0], [4, 5]], np.int64),
            verify_plan=kc.VerifyPlan.allocate(1), write_plan=wp)
    kc.write(ctx, wp, input_ids=_i64([5, 6]), positions=_i64([0, 1]), out_cache_loc=_i64([4, 5]))
    plan = kc.VerifyPlan.allocate(3)
    kc.plan(req_pool_indices=_i64([1, 2]), prefix_lens=_i64([2, 1]), extend_seq_lens=_i64([0, 0]),
            req_to_token=np.array([[0, 0], [4, 5], [5, 0]], np.int64), verify_plan=plan,
            write_plan=kc.WritePlan.allocate(2))
    kc.verify(ctx, plan)
    rows = ctx.violation_log.rows()
    assert rows.shape[0] == 1                       # only B's entry (index 2) fails
    arrays = {"slots": plan.verify_slot_indices, "tokens": plan.verify_expected_tokens,
              "positions": plan.verify_expected_positions, "prevs": plan.verify_prev_slot_indices}
    entry_of = F.attribute(rows, plan.verify_slot_indices.copy(),
                           F.recheck_on_host(ctx, arrays, False))
    assert entry_of.tolist() == [2]


def test_repeats_merge_into_one_finding_with_first_last_and_count():
    log = F.FindingLog()
    row = kc.Violation(2, 7, 3, 1, 1, 0, 0, int(kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH))
    made = []

    def evidence():
        made.append(1)
        return F.Evidence("req_1", 3, 7, 7, sources="k0")

    for step in (4, 5, 9):
        log.add(step, "req_1", 3, 7, 0, ("verify_real_kv_hash",), row, evidence)
    log.add(9, "req_2", 3, 7, 0, ("verify_real_kv_hash",), row, evidence)
    first, second = log.all()
    assert (first.first_step, first.last_step, first.count) == (4, 9, 3)
    assert second.request_id == "req_2" and second.count == 1
    assert len(made) == 2                            # explained once per finding
    assert "changed after they were written" in first.explanation


def test_integrations_import_without_torch():
    code = BLOCKER + ("import kvcanary.integrations, kvcanary.integrations.findings\n"
                      "import sys\n"
                      "assert not any(m.split('.')[0] in ('torch', 'transformers') "
                      "for m in sys.modules)\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
