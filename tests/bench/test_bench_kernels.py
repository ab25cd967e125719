"""The kernel benchmarks run (tiny sizes): the CPU one compares kernel and reference bytes
before timing; the GPU one says "no GPU" and exits 0 without a device."""

import importlib.util
from pathlib import Path

import pytest


BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.needs_compiler
def test_cpu_kernel_benchmark_quick(capsys):
    assert _load("bench_kernels_cpu").main(["--quick", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("verify 8x64 NONE", "verify 8x64 ALL 2x256B", "write 2x64", "write 8x1"):
        assert label in out
    assert "numpy/kernel" in out


def test_gpu_benchmark_without_gpu_says_so(capsys):
    bench = _load("bench_gpu")
    try:
        from kvcanary.backends.cuda import require_cupy

        require_cupy()
        pytest.skip("a CUDA device is visible; this checks the no-GPU path")
    except Exception:  # noqa: BLE001
        pass
    assert bench.main(["--quick"]) == 0
    assert capsys.readouterr().out.startswith("no GPU")
