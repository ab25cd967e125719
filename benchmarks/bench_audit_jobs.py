"""Benchmark of ``kvcanary audit`` over several dumps at each ``--jobs`` (not a timed test):
chooses the default worker count by measurement.

    python benchmarks/bench_audit_jobs.py                 # 4 dumps of about 0.45 GiB, -j 1 and 2
    python benchmarks/bench_audit_jobs.py --quick         # small dumps: checks the script works
    python benchmarks/bench_audit_jobs.py --jobs 1,2,4 --repeats 7 --format dir

Synthesises the dumps once, then times the whole command (``python -m kvcanary audit DUMP...
-j N``, a fresh process as a user runs it, files in the page cache after a warm-up run) for
each N in turn, alternating the order every repeat (ABBA) so that a change of load on a shared
machine falls on every N alike. Prints, per N, the median wall time, the dumps' GiB/s and the
ratio to the first N (the baseline, measured in the same run), and the load average."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from kvcanary.dump import save
from kvcanary.synth import Synthesis, SynthConfig


def dump_bytes(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
    return os.path.getsize(path)


def timed_audit(paths: list, jobs: int) -> float:
    command = [sys.executable, "-m", "kvcanary", "audit", *paths, "-j", str(jobs),
               "--backend", "numpy"]
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"audit -j {jobs} exited {done.returncode}: {done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dumps", type=int, default=4)
    parser.add_argument("--jobs", default="1,2", help="comma-separated; the first is the baseline")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--format", choices=["npz", "dir"], default="npz")
    args = parser.parse_args()
    jobs = [int(j) for j in args.jobs.split(",")]
    if args.quick:
        config = dict(requests=200, num_slots=1 << 16, max_running=32, sources=2)
    else:   # about 0.45 GiB per dump: half of bench_synth_audit.py's workload
        config = dict(requests=5_000, num_slots=2 << 20, max_running=128, sources=2,
                      bytes_per_token=96, prompt_len=(64, 640), chunk_size=256, verify_every=0)
    scratch = tempfile.mkdtemp(prefix="kvcanary-bench-jobs-")
    try:
        paths = []
        for index in range(args.dumps):
            synthesis = Synthesis(SynthConfig(**config, seed=index)).run()
            suffix = ".npz" if args.format == "npz" else ""
            paths.append(save(os.path.join(scratch, f"d{index}{suffix}"), **synthesis.arrays()))
            del synthesis
        total = sum(dump_bytes(p) for p in paths)
        load_before = os.getloadavg()
        for j in jobs:   # warm-up: the page cache, and every interpreter's first import
            timed_audit(paths, j)
        times = {j: [] for j in jobs}
        for repeat in range(args.repeats):
            for j in (jobs if repeat % 2 == 0 else jobs[::-1]):
                times[j].append(timed_audit(paths, j))
        load_after = os.getloadavg()
        print(f"audit of {args.dumps} {args.format} dumps, {total / 2**30:.2f} GiB in all, "
              f"{args.repeats} repeats alternating; {os.cpu_count()} CPUs; load average "
              f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
        base = statistics.median(times[jobs[0]])
        for j in jobs:
            median = statistics.median(times[j])
            print(f"  -j {j}: median {median:.2f} s ({total / 2**30 / median:.2f} GiB/s), "
                  f"{base / median:.2f}x the speed of -j {jobs[0]}; runs "
                  + ", ".join(f"{t:.2f}" for t in times[j]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
