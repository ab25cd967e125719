"""A few live requests in a large pool: one lost write (an all-zero record, like the rest of
the pool) costs the diagnosis what the live entries cost, not what the pool holds."""

from __future__ import annotations

import tracemalloc

import numpy as np
from test_audit_flood import written

from kvcanary.audit import audit
from kvcanary.dump import validate

POOL_SLOTS = 1 << 21   # 64 MiB of records, all but 2,100 never written (zero)


def in_large_pool(arrays: dict) -> dict:
    """The written requests' records at the start of a pool of ``POOL_SLOTS`` zero records
    (``np.zeros`` maps untouched pages lazily, so building it is cheap)."""
    canary = np.zeros((POOL_SLOTS, arrays["canary"].shape[1]), np.uint8)
    canary[:arrays["canary"].shape[0]] = arrays["canary"]
    return dict(arrays, canary=canary, kvcanary_dump_version=np.array(1))


def traced_audit(arrays: dict):
    dump = validate("pool.npz", "npz", arrays)
    tracemalloc.start()
    try:
        result = audit(dump, backend="numpy")
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_one_lost_write_in_a_large_pool_costs_what_the_live_entries_cost():
    arrays = in_large_pool(written())
    _, clean_peak = traced_audit(arrays)
    lost = arrays["req_to_token"][2, 350]
    arrays["canary"][lost] = 0                      # the write never landed
    result, peak = traced_audit(arrays)
    assert result.total_violations == 2             # the zero record and its successor's link
    causes = {f.position: f.diagnosis.cause for f in result.findings}
    assert causes[350] == "never-written"
    # Before: every zero record of the pool was a candidate parent (links, a unique and a
    # per-slot table over all 2M slots: tens of MiB); now a few MiB at most, like the clean audit.
    pool_bytes = arrays["canary"].nbytes
    assert peak < max(2 * clean_peak, pool_bytes // 16), (peak, clean_peak, pool_bytes)
