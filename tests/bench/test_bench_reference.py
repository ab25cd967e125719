"""The reference benchmark script still runs (tiny sizes), so it cannot rot."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_reference.py"


def test_bench_reference_quick():
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("verify 8x64 NONE") for line in lines)
    assert any(line.startswith("verify 8x64 ALL 2x256B") for line in lines)
    assert sum(line.startswith("write ") for line in lines) == 2
    assert all("baseline" in line and "ratio" in line for line in lines[1:])
