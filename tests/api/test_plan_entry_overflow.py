"""A batch whose prefix entries sum past int64 is an error, not a wrapped count that reports
"verify enabled" while the plan is disabled."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc


@pytest.mark.parametrize("strict", [False, True])
def test_prefix_entries_past_int64_raise_and_leave_the_plans_as_they_were(strict):
    verify_plan, write_plan = kc.VerifyPlan.allocate(4), kc.WritePlan.allocate(2)
    before = [a.copy() for a in (*verify_plan.arrays().values(), *write_plan.arrays().values())]
    with pytest.raises(kc.CanaryError, match="prefix_lens.*past int64"):
        kc.plan(req_pool_indices=np.array([1, 2]), prefix_lens=np.array([2**62, 2**62]),
                extend_seq_lens=np.zeros(2, np.int64), req_to_token=np.zeros((3, 4), np.int64),
                verify_plan=verify_plan, write_plan=write_plan, strict=strict)
    after = [*verify_plan.arrays().values(), *write_plan.arrays().values()]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_entries_needed_is_exact_up_to_int64_and_refuses_past_it():
    rows = np.array([1, 2, 0])
    assert kc.entries_needed(rows, np.array([2**62, 2**62 - 1, 2**62])) == 2**63 - 1
    with pytest.raises(kc.CanaryError, match="prefix_lens"):
        kc.entries_needed(rows, np.array([2**62, 2**62, 0]))
