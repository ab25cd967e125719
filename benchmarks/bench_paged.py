"""Benchmark: plan and audit of 1M entries from a block table against the per-token table it
stands for, in the same run (not a timed test).

    python benchmarks/bench_paged.py [--quick] [--repeats N] [--block-size B]

256 requests x 4096-token prefixes = 1,048,576 entries, block size 16, blocks handed out in a
shuffled order (as after reuse); the per-token form is the same layout written out as
``req_to_token``. Prints medians of the plan (verify plan of every prefix, numpy backend), the
audit of each dump from disk (mode NONE, clean canary), and both dump sizes; ratios are
per-token time / block-table time (above 1: the block table is faster) and per-token bytes /
block-table bytes."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import kvcanary as kc
from kvcanary.audit import audit
from kvcanary.dump import save


def layout(requests: int, length: int, block_size: int, seed: int = 0):
    """``(block_table, req_to_token, num_slots)``: row 0 is padding, blocks shuffled."""
    blocks_per_row = length // block_size
    rng = np.random.default_rng(seed)
    blocks = rng.permutation(np.arange(1, requests * blocks_per_row + 1)).astype(np.int32)
    block_table = np.zeros((requests + 1, blocks_per_row), dtype=np.int32)
    block_table[1:] = blocks.reshape(requests, blocks_per_row)
    offsets = np.arange(length) % block_size
    req_to_token = (np.repeat(block_table, block_size, axis=1) * block_size + offsets).astype(np.int32)
    req_to_token[0] = 0
    return block_table, req_to_token, (requests * blocks_per_row + 1) * block_size


def stamp_canary(req_to_token, num_slots: int, length: int) -> np.ndarray:
    """A clean canary: every request's prefix written through ``kc.write`` (one prefill)."""
    requests = req_to_token.shape[0] - 1
    context = kc.CanaryContext(np.zeros((num_slots, 32), np.uint8),
                               kernel_kind=kc.LaunchTag.TAIL_K_FULL,
                               violation_log=kc.ViolationLog.allocate(16),
                               slot_run_counter=np.zeros(1, np.int64),
                               kernel_run_counter=np.zeros(1, np.int64))
    write_plan = kc.WritePlan.allocate(requests)
    rows = np.arange(1, requests + 1, dtype=np.int64)
    kc.plan(req_pool_indices=rows, prefix_lens=np.zeros(requests, np.int64),
            extend_seq_lens=np.full(requests, length, np.int64), req_to_token=req_to_token,
            verify_plan=kc.VerifyPlan.allocate(1), write_plan=write_plan)
    tokens = np.arange(requests * length, dtype=np.int64) % 30000 + 1
    positions = np.tile(np.arange(length, dtype=np.int64), requests)
    kc.write(context, write_plan, input_ids=tokens, positions=positions,
             out_cache_loc=req_to_token[1:].reshape(-1).astype(np.int64))
    assert context.violation_log.total == 0
    return context.canary_buf


def medians(functions: dict, repeats: int) -> dict:
    """Median seconds of each function, run in turns (so a shared machine's load falls on
    both forms alike)."""
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            started = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def size_of(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="64 requests x 1024 tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    requests, length = (64, 1024) if args.quick else (256, 4096)
    block_table, req_to_token, num_slots = layout(requests, length, args.block_size)
    entries = requests * length
    rows = np.arange(1, requests + 1, dtype=np.int64)
    prefix = np.full(requests, length, np.int64)
    tables = {"per-token": dict(req_to_token=req_to_token),
              "block table": dict(block_table=block_table, block_size=args.block_size)}

    def plan(table):
        kc.plan(req_pool_indices=rows, prefix_lens=prefix,
                extend_seq_lens=np.zeros(requests, np.int64),
                verify_plan=kc.VerifyPlan.allocate(entries), write_plan=kc.WritePlan.allocate(requests),
                **table)

    canary = stamp_canary(req_to_token, num_slots, length)
    scratch = tempfile.mkdtemp(prefix="kvcanary-bench-paged-")
    try:
        paths = {}
        for name, table in tables.items():
            paths[name] = path = os.path.join(scratch, name.replace(" ", "_"))
            save(path, canary=canary, req_pool_indices=rows, seq_lens=prefix, **table)
            result = audit(path, backend="numpy")
            assert result.total_violations == 0 and result.entries_checked == entries
        plan_s = medians({name: (lambda t=table: plan(t)) for name, table in tables.items()},
                         args.repeats)
        audit_s = medians({name: (lambda p=path: audit(p, backend="numpy"))
                           for name, path in paths.items()}, args.repeats)
        figures = {name: (plan_s[name], audit_s[name], size_of(paths[name])) for name in tables}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{requests} requests x {length} tokens = {entries} entries, block size "
          f"{args.block_size}, numpy backend, medians of {args.repeats}")
    for name, (plan_s, audit_s, size) in figures.items():
        print(f"{name:12s} plan {entries / plan_s / 1e6:6.1f} M entries/s ({plan_s * 1e3:6.1f} ms)"
              f"   audit {entries / audit_s / 1e6:6.1f} M entries/s ({audit_s * 1e3:6.1f} ms)"
              f"   dump {size / 2**20:7.2f} MiB")
    (flat_plan, flat_audit, flat_size), (paged_plan, paged_audit, paged_size) = figures.values()
    print(f"per-token / block table: plan time {flat_plan / paged_plan:.2f}x, audit time "
          f"{flat_audit / paged_audit:.2f}x, dump size {flat_size / paged_size:.2f}x")


if __name__ == "__main__":
    main()
