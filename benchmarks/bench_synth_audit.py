"""Benchmark of synth and audit at scale (not a timed test).

    python benchmarks/bench_synth_audit.py            # 10,000 requests, 4M slots, ~1 GiB dump
    python benchmarks/bench_synth_audit.py --quick    # a small run to check the script works

Prints the synth time (the issue's bound: under 60 s for 10,000 requests and 4M slots) and the
audit time of the dump it wrote (bound: a 1 GiB dump audits in under 60 s)."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from kvcanary.audit import audit
from kvcanary.dump import save
from kvcanary.synth import Synthesis, SynthConfig


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        config = SynthConfig(requests=200, num_slots=1 << 16, max_running=32, sources=2)
    else:
        config = SynthConfig(requests=10_000, num_slots=4 << 20, max_running=128, sources=2,
                             bytes_per_token=96, prompt_len=(64, 640), chunk_size=256,
                             verify_every=0)
    scratch = tempfile.mkdtemp(prefix="kvcanary-bench-")
    try:
        started = time.perf_counter()
        synthesis = Synthesis(config).run()
        synth_s = time.perf_counter() - started
        path = os.path.join(scratch, "dump")
        started = time.perf_counter()
        save(path, **synthesis.arrays())
        save_s = time.perf_counter() - started
        del synthesis
        started = time.perf_counter()
        result = audit(path, backend="numpy")
        audit_s = time.perf_counter() - started
        size = directory_bytes(path)
        print(f"synth  {config.requests} requests, {config.num_slots} slots: {synth_s:.1f} s "
              f"(save {save_s:.1f} s)")
        print(f"audit  {size / 2**30:.2f} GiB dump, {result.entries_checked} entries, "
              f"{result.total_violations} violations: {audit_s:.1f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
