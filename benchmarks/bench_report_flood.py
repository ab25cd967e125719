"""Benchmark of the HTML report on the worst dump: the flooded 1M-entry dump of
``bench_audit_flood.py`` (every record corrupt) audited through the command line as text,
and again with ``--html``.

    python benchmarks/bench_report_flood.py            # 256 requests x 4096 tokens
    python benchmarks/bench_report_flood.py --quick    # a small run to check the script works

Prints the median wall time of each (fresh processes, interleaved), their ratio (goal
<= 1.5x: the maps aggregate while the audit runs) and the report's size (goal < 2 MB)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_audit_flood import build_dump, run  # noqa: E402

MODE = "all"   # real-KV hashing of the whole token: the slowest text audit, as in bench_audit_flood
SIZE_GOAL = 2_000_000
RATIO_GOAL = 1.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    requests, tokens = (16, 256) if args.quick else (256, 4096)
    scratch = tempfile.mkdtemp(prefix="kvcanary-report-flood-")
    try:
        dump = os.path.join(scratch, "flooded")
        build_dump(dump, requests, tokens, 64, MODE, flood=True)
        page = os.path.join(scratch, "report.html")
        common = ("kvcanary", "audit", dump, "--backend", "numpy")
        times = {"text": [], "html": []}
        for _ in range(args.repeats):   # interleaved, so a change in load hits both alike
            times["text"].append(run(*common)[0])
            times["html"].append(run(*common, "--html", page)[0])
        text, html = (statistics.median(times[k]) for k in ("text", "html"))
        size = os.path.getsize(page)
        ratio = html / text
        print(f"dump: {requests} requests x {tokens} tokens = {requests * tokens} entries, "
              f"every record corrupt (real-KV mode {MODE})")
        print(f"text audit:   {text:6.2f} s (median of {args.repeats})")
        print(f"html audit:   {html:6.2f} s; report {size} bytes (goal < {SIZE_GOAL})")
        print(f"html / text time: {ratio:.2f}x (goal <= {RATIO_GOAL}x)")
        print("goals met" if size < SIZE_GOAL and ratio <= RATIO_GOAL else "GOALS MISSED")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
