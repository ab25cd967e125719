"""The host-overhead benchmark runs (a few calls): on each CuPy of KVCANARY_CUPY_PATHS,
and here, where without CuPy it says so and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_cuda_host_side import NOT_SET, ROOT, cupy_paths

BENCH = ROOT / "benchmarks" / "bench_host_overhead.py"


def test_without_cupy_says_so():
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("cupy is installed here: the listed-CuPy test runs the benchmark")
    done = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("no cupy")


@pytest.mark.parametrize("path", cupy_paths()[-1:] or [
    pytest.param(None, marks=pytest.mark.skip(reason=NOT_SET))])
def test_times_every_call_on_listed_cupy(path, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, str(ROOT)]))
    figures = tmp_path / "host.json"
    done = subprocess.run([sys.executable, str(BENCH), "--calls", "20", "--repeats", "1",
                           "--json", str(figures)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(Path(figures).read_text())
    assert {name: results[name]["launches"] for name in ("write", "verify", "plan")} == {
        "write": 4, "verify": 1, "plan": 3}
    for name in ("write", "verify", "plan"):
        assert 0 < results[name]["launcher_us"] and 0 < results[name]["api_us"]
        assert f"kc.{name}" in done.stdout
