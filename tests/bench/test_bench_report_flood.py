"""The report benchmark still runs (tiny sizes), so it cannot rot: both audits run, the report's
size and the time ratio are printed, and the flooded report stays under its size goal."""

import pathlib
import re
import subprocess
import sys

import pytest

import skip_reasons

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_report_flood.py"


def test_bench_report_flood_quick():
    pytest.importorskip("jinja2", reason=skip_reasons.REPORT)
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--repeats", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^text audit:\s+[\d.]+ s", out, re.M)
    size = int(re.search(r"^html audit:\s+[\d.]+ s; report (\d+) bytes", out, re.M).group(1))
    assert 0 < size < 2_000_000
    assert re.search(r"^html / text time: [\d.]+x", out, re.M)
