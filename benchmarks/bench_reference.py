"""Throughput of the numpy reference, each figure beside a plain-numpy baseline that moves
the same bytes, measured in the same run.

  verify  256 requests x 4096-token prefixes = 1,048,576 entries, mode NONE, and mode ALL
          with 2 real-KV sources of 256 bytes/token
          baseline: gather the canary rows of every entry and of its predecessor by slot
          index (plus, for ALL, gather every entry's real-KV bytes from each source)
  verify  64 requests x 32-token prefixes, mode ALL with 1 source of 3072 bytes/token (a
          decode step of the transformers guard's k0 at GPT-2 small's width: the real-KV
          fold of 6 MiB), same baseline
  write   prefill 8 x 4096 tokens and decode 256 x 1 token (mode NONE)
          baseline: scatter the same 32-byte records into the buffer by slot index

Usage: python benchmarks/bench_reference.py [--quick] [--repeats N]
Single-threaded by default (OMP/OPENBLAS/MKL threads = 1), so the figures are per core.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import kvcanary as kc  # noqa: E402

TARGET_VERIFY_NONE_S = 0.25  # 1,048,576 entries, mode NONE, one core


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Pool:
    """A canary buffer holding ``num_reqs`` chains of ``length`` tokens each, written by
    kc.write, plus the request table that maps them (slot 0 is padding)."""

    def __init__(self, num_reqs: int, length: int, sources=(), mode=kc.RealKvHashMode.NONE):
        self.num_slots = num_reqs * length + 1
        self.table = np.zeros((num_reqs + 1, length), dtype=np.int32)
        self.table[1:] = np.arange(1, self.num_slots, dtype=np.int32).reshape(num_reqs, length)
        self.ctx = make_context(self.num_slots, sources, mode)
        self.rows = np.arange(1, num_reqs + 1, dtype=np.int64)
        self.length = length
        verify_plan, write_plan = self.plan(prefix=0, extend=length)
        tokens = np.random.default_rng(0).integers(0, 150_000, size=num_reqs * length)
        positions = np.tile(np.arange(length, dtype=np.int64), num_reqs)
        kc.write(self.ctx, write_plan, input_ids=tokens.astype(np.int64), positions=positions,
                 out_cache_loc=self.table[1:].reshape(-1).astype(np.int64))

    def plan(self, prefix: int, extend: int, rows=None):
        rows = self.rows if rows is None else rows
        n = rows.size
        verify_plan = kc.VerifyPlan.allocate(max(1, n * prefix))
        write_plan = kc.WritePlan.allocate(n)
        kc.plan(req_pool_indices=rows, prefix_lens=np.full(n, prefix, np.int64),
                extend_seq_lens=np.full(n, extend, np.int64), req_to_token=self.table,
                verify_plan=verify_plan, write_plan=write_plan)
        return verify_plan, write_plan


def make_context(num_slots, sources=(), mode=kc.RealKvHashMode.NONE):
    return kc.CanaryContext(
        np.zeros((num_slots, kc.CANARY_SLOT_BYTES), dtype=np.uint8),
        kernel_kind=kc.LaunchTag.TAIL_K_FULL, violation_log=kc.ViolationLog.allocate(1024),
        slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64),
        real_kv_sources=sources, real_kv_hash_mode=mode)


def make_sources(count: int, num_slots: int, bytes_per_token: int):
    rng = np.random.default_rng(1)
    return [kc.RealKvSource(rng.integers(0, 256, size=(num_slots, bytes_per_token),
                                         dtype=np.uint8),
                            page_size=1, num_bytes_per_token=bytes_per_token,
                            read_bytes=bytes_per_token) for _ in range(count)]


def report(name: str, units: str, count: int, seconds: float, baseline: float) -> dict:
    rate, base_rate = count / seconds, count / baseline
    print(f"{name:<34} {rate:>14,.0f} {units}/s  {seconds * 1e3:9.2f} ms   "
          f"baseline {base_rate:>14,.0f} {units}/s  {baseline * 1e3:9.2f} ms   "
          f"ratio {seconds / baseline:6.2f}x")
    return {"name": name, "seconds": seconds, "baseline_seconds": baseline, "count": count}


def bench_verify(num_reqs, length, repeats, sources_count=0, bytes_per_token=256):
    mode = kc.RealKvHashMode.ALL if sources_count else kc.RealKvHashMode.NONE
    sources = make_sources(sources_count, num_reqs * length + 1, bytes_per_token) \
        if sources_count else ()
    pool = Pool(num_reqs, length, sources, mode)
    verify_plan, _ = pool.plan(prefix=length, extend=0)
    n = int(verify_plan.verify_num_valid[0])
    ctx = pool.ctx

    def run():
        kc.verify(ctx, verify_plan)

    run()
    if int(ctx.violation_log.write_index[0]):
        raise SystemExit("benchmark pool does not verify clean")
    records = ctx.canary_buf.view("<i8")[:, :4]
    slots = verify_plan.verify_slot_indices[:n]
    prevs = np.maximum(verify_plan.verify_prev_slot_indices[:n], 0)
    byte_rows = [s.tensor for s in sources]

    def baseline():
        records[slots]
        records[prevs]
        for rows in byte_rows:
            rows[slots]

    label = f"verify {num_reqs}x{length} " + (
        f"ALL {sources_count}x{bytes_per_token}B" if sources_count else "NONE")
    return report(label, "entries", n, median_seconds(run, repeats),
                  median_seconds(baseline, repeats))


def bench_write(num_reqs, extend, repeats, prefix):
    pool = Pool(num_reqs, prefix + extend)
    _, write_plan = pool.plan(prefix=prefix, extend=extend)
    loc = pool.table[1:, prefix:prefix + extend].reshape(-1).astype(np.int64)
    n = loc.size
    tokens = np.arange(n, dtype=np.int64)
    positions = np.tile(np.arange(prefix, prefix + extend, dtype=np.int64), num_reqs)
    ctx = pool.ctx

    def run():
        kc.write(ctx, write_plan, input_ids=tokens, positions=positions, out_cache_loc=loc)

    records = ctx.canary_buf.view("<i8")[:, :4]
    new = np.zeros((n, 4), dtype=np.int64)

    def baseline():
        records[loc] = new

    label = f"write {num_reqs}x{extend} (prefix {prefix})"
    return report(label, "tokens", n, median_seconds(run, repeats),
                  median_seconds(baseline, repeats))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median)")
    args = parser.parse_args(argv)
    reqs, length = (8, 64) if args.quick else (256, 4096)
    prefill_reqs, prefill_len = (2, 64) if args.quick else (8, 4096)
    decode_reqs, decode_prefix = (8, 16) if args.quick else (256, 4096)
    repeats = max(1, args.repeats if not args.quick else min(args.repeats, 2))

    print(f"kvcanary {kc.__version__} numpy {np.__version__} reference benchmark "
          f"(median of {repeats} runs)")
    results = [
        bench_verify(reqs, length, repeats),
        bench_verify(reqs, length, repeats, sources_count=2, bytes_per_token=256),
        bench_verify(8 if args.quick else 64, 32, repeats, sources_count=1,
                     bytes_per_token=3072),
        bench_write(prefill_reqs, prefill_len, repeats, prefix=0),
        bench_write(decode_reqs, 1, repeats, prefix=decode_prefix),
    ]
    if not args.quick:
        verify_none = results[0]["seconds"]
        verdict = "met" if verify_none < TARGET_VERIFY_NONE_S else "MISSED"
        print(f"target: verify of 1,048,576 entries in mode NONE under "
              f"{TARGET_VERIFY_NONE_S} s: {verify_none:.3f} s ({verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
