"""Benchmark of the audit when many entries share one slot (a row filled with one slot, a
plausible engine bug): the same count of violating entries on one slot and on distinct
slots, live and as prefix-cache sweep entries, audited in this process on the numpy backend.

    python benchmarks/bench_audit_shared_slot.py            # 2**16 and 2**18 entries
    python benchmarks/bench_audit_shared_slot.py --quick    # a small run to check the script

Prints the median seconds of each audit, the entries per second and the ratio of the
shared-slot audit to the distinct-slot one measured in the same run (goal: at most 2x)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from kvcanary.audit import audit
from kvcanary.dump import load, save


def live(entries: int, shared: bool) -> dict:
    table = np.zeros((2, entries), np.int32)
    table[1] = 1 if shared else np.arange(1, entries + 1)
    return dict(canary=np.zeros((entries + 1, 32), np.uint8), req_to_token=table,
                req_pool_indices=np.array([1], np.int64), seq_lens=np.array([entries], np.int64))


def sweep(entries: int, shared: bool) -> dict:
    slots = np.ones(entries, np.int64) if shared else np.arange(1, entries + 1, dtype=np.int64)
    return dict(canary=np.zeros((entries + 1, 32), np.uint8),
                req_to_token=np.ones((2, 1), np.int32), req_pool_indices=np.array([0], np.int64),
                seq_lens=np.array([0], np.int64), sweep_slot_indices=slots,
                sweep_prev_slot_indices=np.full(entries, -1, np.int64),
                sweep_positions=np.ones(entries, np.int64))


def median_seconds(path: str, repeats: int) -> float:
    dump, times = load(path), []
    for _ in range(repeats):
        started = time.perf_counter()
        result = audit(dump, backend="numpy")
        times.append(time.perf_counter() - started)
    assert result.total_violations == result.entries_checked   # every entry is a finding
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2**10 entries, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    sizes, repeats = ([1 << 10], 1) if args.quick else ([1 << 16, 1 << 18], args.repeats)
    with tempfile.TemporaryDirectory() as scratch:
        for kind, build in (("live", live), ("sweep", sweep)):
            for entries in sizes:
                seconds = {}
                for shared in (False, True):   # alternating sides of one measurement
                    path = save(os.path.join(scratch, f"{kind}-{shared}.npz"),
                                **build(entries, shared))
                    seconds[shared] = median_seconds(path, repeats)
                ratio = seconds[True] / seconds[False]
                print(f"{kind:5} {entries:>7} entries: distinct slots {seconds[False]:.3f} s "
                      f"({entries / seconds[False]:,.0f}/s), one slot {seconds[True]:.3f} s "
                      f"({entries / seconds[True]:,.0f}/s): ratio {ratio:.2f}x (goal <= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
