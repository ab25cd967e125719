"""The CUDA kernel source compiled natively (g++ -O3 through the test shim, one thread)
against the numpy reference, on the reference benchmark's shapes, both measured in the
same run (median of several runs each):

  verify  256 requests x 4096-token prefixes = 1,048,576 entries, mode NONE, and mode ALL
          with 2 real-KV sources of 256 bytes/token
  write   prefill 8 x 4096 tokens and decode 256 x 1 token (mode NONE)

Each kernel run is first checked to leave the same bytes as the reference.
Usage: python benchmarks/bench_kernels_cpu.py [--quick] [--repeats N]"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import kvcanary as kc  # noqa: E402
from bench_reference import Pool, make_sources, median_seconds  # noqa: E402
from kernel_harness import CpuKernels, compiler, numpy_runs  # noqa: E402

NATIVE_FLAGS = ("-O3",)
TARGET_RATIO = 4.0  # numpy verify within 4x of the native single-thread kernel


def fresh_copy(ctx):
    twin = copy.copy(ctx)
    twin.canary_buf = ctx.canary_buf.copy()
    twin.slot_run_counter = ctx.slot_run_counter.copy()
    twin.kernel_run_counter = ctx.kernel_run_counter.copy()
    twin.violation_log = kc.ViolationLog(ctx.violation_log.ring.copy(),
                                         ctx.violation_log.write_index.copy())
    return twin


def same_state(a, b) -> bool:
    return (np.array_equal(a.canary_buf, b.canary_buf)
            and np.array_equal(a.violation_log.write_index, b.violation_log.write_index)
            and np.array_equal(a.slot_run_counter, b.slot_run_counter))


def line(name, units, count, reference_s, kernel_s) -> dict:
    print(f"{name:<30} numpy {count / reference_s:>14,.0f} {units}/s {reference_s * 1e3:9.2f} ms"
          f"   kernel {count / kernel_s:>14,.0f} {units}/s {kernel_s * 1e3:9.2f} ms"
          f"   numpy/kernel {reference_s / kernel_s:6.2f}x")
    return {"name": name, "reference_s": reference_s, "kernel_s": kernel_s}


def compare(name, units, count, launch, ctx, kernels, repeats):
    """Time ``launch`` on the reference and on the kernels; check both leave equal bytes."""
    ref_ctx, ker_ctx = fresh_copy(ctx), fresh_copy(ctx)
    launch(ref_ctx)
    with numpy_runs(kernels):
        launch(ker_ctx)
    if not same_state(ref_ctx, ker_ctx):
        raise SystemExit(f"{name}: kernel and reference disagree")
    reference_s = median_seconds(lambda: launch(ctx), repeats)
    with numpy_runs(kernels):
        kernel_s = median_seconds(lambda: launch(ctx), repeats)
    return line(name, units, count, reference_s, kernel_s)


def bench_verify(kernels, reqs, length, repeats, sources_count=0, bytes_per_token=256):
    mode = kc.RealKvHashMode.ALL if sources_count else kc.RealKvHashMode.NONE
    sources = make_sources(sources_count, reqs * length + 1, bytes_per_token) \
        if sources_count else ()
    pool = Pool(reqs, length, sources, mode)
    plan, _ = pool.plan(prefix=length, extend=0)
    n = int(plan.verify_num_valid[0])
    label = f"verify {reqs}x{length} " + (
        f"ALL {sources_count}x{bytes_per_token}B" if sources_count else "NONE")
    return compare(label, "entries", n, lambda ctx: kc.verify(ctx, plan), pool.ctx, kernels,
                   repeats)


def bench_write(kernels, reqs, extend, repeats, prefix):
    pool = Pool(reqs, prefix + extend)
    _, plan = pool.plan(prefix=prefix, extend=extend)
    loc = pool.table[1:, prefix:prefix + extend].reshape(-1).astype(np.int64)
    tokens = np.arange(loc.size, dtype=np.int64)
    positions = np.tile(np.arange(prefix, prefix + extend, dtype=np.int64), reqs)

    def launch(ctx):
        kc.write(ctx, plan, input_ids=tokens, positions=positions, out_cache_loc=loc)

    return compare(f"write {reqs}x{extend} (prefix {prefix})", "tokens", loc.size, launch,
                   pool.ctx, kernels, repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median)")
    args = parser.parse_args(argv)
    if compiler() is None:
        print("no C++ compiler: cannot build the kernel source for the CPU")
        return 0
    reqs, length = (8, 64) if args.quick else (256, 4096)
    prefill_reqs, prefill_len = (2, 64) if args.quick else (8, 4096)
    decode_reqs, decode_prefix = (8, 16) if args.quick else (256, 4096)
    repeats = max(1, min(args.repeats, 2) if args.quick else args.repeats)
    # One "multiprocessor": 4 blocks x 256 threads, run sequentially on one core.
    kernels = CpuKernels(multiprocessor_count=1, threads_per_block=256,
                         write_threads_per_block=128, flags=NATIVE_FLAGS)
    print(f"kvcanary {kc.__version__}: kernel source via g++ {' '.join(NATIVE_FLAGS)} "
          f"(one thread) vs numpy {np.__version__} reference, median of {repeats} runs")
    results = [
        bench_verify(kernels, reqs, length, repeats),
        bench_verify(kernels, reqs, length, repeats, sources_count=2, bytes_per_token=256),
        bench_write(kernels, prefill_reqs, prefill_len, repeats, prefix=0),
        bench_write(kernels, decode_reqs, 1, repeats, prefix=decode_prefix),
    ]
    if not args.quick:
        ratio = results[0]["reference_s"] / results[0]["kernel_s"]
        verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
        print(f"target: numpy verify (NONE) within {TARGET_RATIO:.0f}x of the native kernel: "
              f"{ratio:.2f}x ({verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
