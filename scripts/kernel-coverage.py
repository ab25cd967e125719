#!/usr/bin/env python3
"""Line coverage of the CUDA kernel sources (kernels/*.cu, *.cuh) by the CPU test harness.

The harness compiles the kernels with g++ through a shim of CUDA's built-ins; with
KVCANARY_HARNESS_COVERAGE=1 it builds them with --coverage into a fresh cache folder. This
script runs the kernel test subset that way, reads the counts back with ``gcov
--json-format`` (one report per kernel variant: source-count bound, token check), merges
them per source line, prints the line and branch-outcome coverage of each kernel file and
lists every line no test executed and every branch outcome never taken.

    python scripts/kernel-coverage.py                # the default subset, a few minutes
    python scripts/kernel-coverage.py -- -k plan     # extra pytest arguments after --
    python scripts/kernel-coverage.py --fail-under 100
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
# Every test module that runs the kernels on the CPU (the sanitizer module only re-runs
# part of this subset in a child process with a different build, so it is left out).
SUBSET = ["tests/kernels/cpu/test_kernels_cpu_out_of_range.py", "tests/kernels/cpu/test_kernels_cpu_plan.py",
          "tests/kernels/cpu/test_kernels_cpu_properties.py", "tests/reference/test_reference_plan.py",
          "tests/reference/test_reference_verify.py", "tests/reference/test_reference_write.py",
          "tests/kernels/cpu/test_kernels_cpu_coverage.py", "tests/kernels/test_kernels_launch.py",
          "tests/cli/test_smoke.py", "tests/api/test_fuzz_api.py",
          "tests/reference/test_paged_plan.py", "tests/reference/test_ring_saturation.py"]


def run_subset(cache: Path, extra: list[str]) -> None:
    env = dict(os.environ, KVCANARY_HARNESS_COVERAGE="1", KVCANARY_HARNESS_CACHE=str(cache))
    tests = [t for t in SUBSET if (ROOT / t).exists()]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, *extra]
    subprocess.run(command, cwd=ROOT, env=env, check=True)


def gcov_counts(cache: Path):
    """Execution counts merged over every kernel variant (source-count bound, token check):
    ``{source: {line: count}}`` and ``{source: {(line, outcome): count}}`` for the
    branch outcomes (exception edges left out: the kernels throw nothing)."""
    lines = defaultdict(lambda: defaultdict(int))
    branches = defaultdict(lambda: defaultdict(int))
    for gcda in sorted(cache.glob("*.gcda")):
        output = subprocess.run(["gcov", "--branch-probabilities", "--json-format", "--stdout",
                                 gcda.name], cwd=cache, check=True, capture_output=True,
                                text=True).stdout
        for document in output.splitlines():  # one JSON document per line
            for source in json.loads(document)["files"]:
                path = Path(source["file"]).resolve()
                if path.parent != KERNELS:
                    continue
                for entry in source["lines"]:
                    number = entry["line_number"]
                    lines[path][number] += entry["count"]
                    outcomes = [b for b in entry.get("branches", []) if not b.get("throw")]
                    for index, branch in enumerate(outcomes):
                        branches[path][(number, index)] += branch["count"]
    return lines, branches


def _percent(hit: int, total: int) -> float:
    return 100.0 * hit / total if total else 100.0


def report(lines, branches) -> float:
    """Prints the table and what was not run; returns the line coverage in percent."""
    sums = [0, 0, 0, 0]
    missed = []
    print(f"{'file':<18}{'lines':>7}{'run':>6}{'line %':>8}{'branch outcomes':>17}{'taken':>7}"
          f"{'branch %':>10}")
    for path in sorted(KERNELS.glob("*.cu*")):
        counts, outcomes = lines.get(path, {}), branches.get(path, {})
        hit = sum(1 for n in counts.values() if n > 0)
        taken = sum(1 for n in outcomes.values() if n > 0)
        for i, value in enumerate((len(counts), hit, len(outcomes), taken)):
            sums[i] += value
        print(f"{path.name:<18}{len(counts):>7}{hit:>6}{_percent(hit, len(counts)):>7.1f}%"
              f"{len(outcomes):>17}{taken:>7}{_percent(taken, len(outcomes)):>9.1f}%")
        source = path.read_text().splitlines()
        missed += [f"line not run: {path.name}:{n}: {source[n - 1].strip()}"
                   for n, c in sorted(counts.items()) if c == 0]
        missed += [f"branch outcome not taken: {path.name}:{n} (outcome {k}): "
                   f"{source[n - 1].strip()}" for (n, k), c in sorted(outcomes.items()) if c == 0]
    total, hit, total_outcomes, taken = sums
    print(f"{'all kernels':<18}{total:>7}{hit:>6}{_percent(hit, total):>7.1f}%"
          f"{total_outcomes:>17}{taken:>7}{_percent(taken, total_outcomes):>9.1f}%")
    print("\n".join(missed))
    return _percent(hit, total)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail-under", type=float, default=None,
                        help="exit 1 when the line coverage is below this percentage")
    parser.add_argument("--keep", type=Path, default=None,
                        help="build folder to use and keep (default: a temporary one)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    if shutil.which("gcov") is None:
        print("kernel-coverage: gcov is not installed (it comes with gcc)", file=sys.stderr)
        return 2
    cache = args.keep or Path(tempfile.mkdtemp(prefix="kvcanary-kernel-coverage-"))
    cache.mkdir(parents=True, exist_ok=True)
    try:
        run_subset(cache, args.pytest_args)
        percent = report(*gcov_counts(cache))
    finally:
        if args.keep is None:
            shutil.rmtree(cache, ignore_errors=True)
    return 1 if args.fail_under is not None and percent < args.fail_under else 0


if __name__ == "__main__":
    sys.exit(main())
