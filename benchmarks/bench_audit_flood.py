"""Benchmark of a flooded audit: the same 1M-entry dump audited clean and with the stored
position of every record flipped (every entry a finding), through the command line.

    python benchmarks/bench_audit_flood.py              # 256 requests x 4096 tokens, mode all
    python benchmarks/bench_audit_flood.py --mode none  # no real-KV hashing: the fastest clean audit
    python benchmarks/bench_audit_flood.py --quick      # a small run to check the script works

For each of clean/flooded x text/JSON it runs ``python -m kvcanary audit`` in a fresh
process and prints the median wall time, the process's peak resident memory and the bytes
written to stdout. Yardsticks from the same run: the flooded/clean time ratio (goal <= 2x),
the dump's size and the peak memory of an interpreter that only imports the command line
(goal: peak <= 2x dump + interpreter), and the output size (goal < 1 MB)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import kvcanary as kc
from kvcanary.dump import save

MB = 1 << 20
OUTPUT_GOAL = 1_000_000


def build_dump(path: str, requests: int, tokens: int, bytes_per_token: int, mode: str,
               flood: bool) -> None:
    """A prefill of ``requests x tokens`` written through ``kc.plan``/``kc.write`` with one
    real-KV source hashed in ``mode``; ``flood`` flips the stored position of every record."""
    rng = np.random.default_rng(0)
    num_slots = requests * tokens + 1
    slots = rng.permutation(np.arange(1, num_slots, dtype=np.int64))
    table = np.zeros((requests + 1, tokens), np.int32)
    table[1:] = slots.reshape(requests, tokens)
    canary = np.zeros((num_slots, kc.CANARY_SLOT_BYTES), np.uint8)
    real_kv = rng.integers(0, 256, (num_slots, bytes_per_token), dtype=np.uint8)
    source = kc.RealKvSource(real_kv, page_size=1, num_bytes_per_token=bytes_per_token,
                             read_bytes=bytes_per_token)
    rows = np.arange(1, requests + 1, dtype=np.int64)
    seq_lens = np.full(requests, tokens, np.int64)
    context = kc.CanaryContext(canary, kernel_kind=kc.LaunchTag.TAIL_K_FULL,
                               violation_log=kc.ViolationLog.allocate(1),
                               slot_run_counter=np.zeros(1, np.int64),
                               kernel_run_counter=np.zeros(1, np.int64),
                               real_kv_sources=(source,),
                               real_kv_hash_mode=kc.RealKvHashMode[mode.upper()])
    write_plan = kc.WritePlan.allocate(requests)
    kc.plan(req_pool_indices=rows, prefix_lens=np.zeros(requests, np.int64),
            extend_seq_lens=seq_lens, req_to_token=table,
            verify_plan=kc.VerifyPlan.allocate(1), write_plan=write_plan)
    positions = np.tile(np.arange(tokens, dtype=np.int64), requests)
    kc.write(context, write_plan, input_ids=(positions * 7 + 1) % 32000, positions=positions,
             out_cache_loc=table[1:].reshape(-1).astype(np.int64))
    if flood:
        canary.view(np.int64)[1:, 1] ^= 1   # every record's stored position
    save(path, canary=canary, req_to_token=table, req_pool_indices=rows, seq_lens=seq_lens,
         real_kv_0=real_kv, real_kv_params=[[1, bytes_per_token, bytes_per_token]],
         real_kv_hash_mode=mode)


# Runs a command line in this interpreter and reports its peak resident memory (VmHWM: the
# high-water mark of this process alone; a child's ru_maxrss would start from its parent's).
PEAK_WRAPPER = """
import atexit, runpy, sys
def peak():
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith('VmHWM:'):
                print('peak_kib', line.split()[1], file=sys.stderr)
atexit.register(peak)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
"""


def run(module: str, *args: str) -> tuple:
    """``(seconds, peak_rss_bytes, stdout_bytes)`` of ``python -m module args`` in a fresh
    process."""
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", PEAK_WRAPPER, module, *args], stdout=out,
                              stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - started
        peak = [line for line in done.stderr.splitlines() if line.startswith("peak_kib")]
        if not peak:
            raise SystemExit(f"{module} {' '.join(args)} failed:\n{done.stderr}")
        out.seek(0, os.SEEK_END)
        return seconds, int(peak[-1].split()[1]) * 1024, out.tell()


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=["none", "partial", "all"], default="all")
    args = parser.parse_args()
    requests, tokens = (16, 256) if args.quick else (256, 4096)
    bytes_per_token = 64
    scratch = tempfile.mkdtemp(prefix="kvcanary-flood-")
    try:
        dumps = {}
        for name in ("clean", "flooded"):
            dumps[name] = os.path.join(scratch, name)
            build_dump(dumps[name], requests, tokens, bytes_per_token, args.mode,
                       name == "flooded")
        size = directory_bytes(dumps["clean"])
        interpreter = statistics.median(
            run("kvcanary", "info")[1] for _ in range(args.repeats))
        print(f"dump: {requests} requests x {tokens} tokens = {requests * tokens} entries, one "
              f"real-KV source of {bytes_per_token} B/token (mode {args.mode}), {size / MB:.1f} MiB; "
              f"interpreter running kvcanary info: {interpreter / MB:.1f} MiB peak")
        print(f"memory goal: peak <= 2 x dump + interpreter = "
              f"{(2 * size + interpreter) / MB:.1f} MiB; output goal < {OUTPUT_GOAL} bytes")
        ok = True
        for fmt in ("text", "json"):
            runs = {name: [] for name in dumps}
            for _ in range(args.repeats):   # interleaved, so a change in load hits both alike
                for name, path in dumps.items():
                    runs[name].append(run("kvcanary", "audit", path, "--backend", "numpy",
                                          "--format", fmt))
            figures = {}
            for name in dumps:
                figures[name] = tuple(statistics.median(r[i] for r in runs[name])
                                      for i in range(3))
                seconds, peak, output = figures[name]
                print(f"{fmt:>4} {name:>7}: {seconds:6.2f} s, peak {peak / MB:7.1f} MiB, "
                      f"output {output:>9} bytes")
                ok &= peak <= 2 * size + interpreter and (name == "clean" or output < OUTPUT_GOAL)
            ratio = figures["flooded"][0] / figures["clean"][0]
            ok &= ratio <= 2
            print(f"{fmt:>4} flooded / clean time: {ratio:.2f}x (goal <= 2x)")
        print("goals met" if ok else "GOALS MISSED")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
