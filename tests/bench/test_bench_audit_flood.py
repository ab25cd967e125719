"""The flooded-audit benchmark still runs (tiny sizes), so it cannot rot, and its flooded
run reports every entry while printing a bounded output."""

import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_audit_flood.py"


def test_bench_audit_flood_quick():
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--repeats", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    runs = re.findall(r"^\s*(text|json)\s+(clean|flooded):\s+[\d.]+ s, peak\s+[\d.]+ MiB, "
                      r"output\s+(\d+) bytes$", out, re.M)
    assert sorted((fmt, name) for fmt, name, _ in runs) == [
        ("json", "clean"), ("json", "flooded"), ("text", "clean"), ("text", "flooded")]
    assert all(int(size) < 1_000_000 for _, _, size in runs)
    assert len(re.findall(r"flooded / clean time: [\d.]+x", out)) == 2
