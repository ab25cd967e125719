"""Shape mistakes of the caller are errors naming the arrays, not findings that look like
corruption: token arrays shorter than the write plan covers."""

import numpy as np
import pytest

import kvcanary as kc
from builders import make_context, ring_rows


def planned(extend: list[int]) -> kc.WritePlan:
    table = np.zeros((len(extend) + 1, 16), np.int32)
    for row in range(1, len(extend) + 1):
        table[row] = np.arange(16) + 16 * row
    write_plan = kc.WritePlan.allocate(len(extend))
    kc.plan(req_pool_indices=np.arange(1, len(extend) + 1), prefix_lens=np.zeros(len(extend),
            np.int64), extend_seq_lens=np.array(extend, np.int64), req_to_token=table,
            verify_plan=kc.VerifyPlan.allocate(64), write_plan=write_plan)
    return write_plan


def test_fewer_tokens_than_the_plan_covers_is_an_error_naming_the_arrays():
    ctx = make_context(num_slots=64)
    plan = planned([2, 3])
    with pytest.raises(ValueError, match=r"^kv-canary: input_ids, positions and out_cache_loc "
                                         r"have 4 entries but the write plan covers 5 tokens"):
        kc.write(ctx, plan, input_ids=np.arange(4), positions=np.arange(4),
                 out_cache_loc=np.arange(16, 20))
    assert ring_rows(ctx) == [] and not ctx.canary_buf.any()


def test_exactly_or_more_tokens_than_planned_write_cleanly():
    # More entries than planned: e.g. a CUDA-graph batch padded past its real tokens.
    for count in (5, 8):
        ctx = make_context(num_slots=64)
        kc.write(ctx, planned([2, 3]), input_ids=np.arange(count), positions=np.arange(count),
                 out_cache_loc=np.array([16, 17, 32, 33, 34, 0, 0, 0][:count]))
        assert ring_rows(ctx) == []
