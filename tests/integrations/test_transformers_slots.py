"""The transformers guard's physical-index-to-slot conversion (integrations/transformers/
engineindex.py ``SlotTable``): the table built once per cache group and the arithmetic used for a
cache too large for the table give the same slot for every index, an index outside the cache
or past a block's K rows the out-of-buffer marker. numpy only (no torch)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcanary.integrations.transformers import engineindex as S


def _session(stride, page, blocks, table=None):
    s = S.SlotTable(stride, page, blocks)
    s.table = table
    return s


def _by_formula(physical, stride, page, blocks):
    out = []
    for p in physical.tolist():
        block, offset = divmod(p, stride)
        ok = p >= 0 and offset < page and block < blocks
        out.append(block * page + offset if ok else blocks * page)
    return out


@pytest.mark.parametrize("stride,page", [(64, 16), (48, 16), (16, 16), (8, 16)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_table_and_arithmetic_agree_with_the_formula(stride, page, dtype):
    blocks = 7
    physical = np.concatenate([np.arange(-3, blocks * stride + 5),
                               [np.iinfo(dtype).min, np.iinfo(dtype).max]]).astype(dtype)
    want = _by_formula(physical.astype(np.int64), stride, page, blocks)
    table = _session(stride, page, blocks)
    assert table.to_slots(physical).tolist() == want
    assert (table.table is not False) == (stride >= page)   # the table was used
    arithmetic = _session(stride, page, blocks, table=False)
    assert arithmetic.to_slots(physical).tolist() == want


def test_a_cache_past_the_table_bound_uses_the_arithmetic(monkeypatch):
    monkeypatch.setattr(S, "MAX_SLOT_TABLE", 10)
    s = _session(64, 16, 7)
    assert s.to_slots(np.array([0, 17, 64, 500])).tolist() == [0, 112, 16, 112]
    assert s.table is False
