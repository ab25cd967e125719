"""``kvcanary smoke``: the no-GPU exit path through click, and the smoke logic itself run
with the CPU-compiled kernels standing in for the device (xp=numpy)."""

import pytest
from click.testing import CliRunner

from kvcanary.cli.main import main
from kernel_harness import CpuKernels, build_variants
from kvcanary.tools.smoke import FAULTS, run_smoke


def _gpu_visible() -> bool:
    try:
        from kvcanary.backends.cuda import require_cupy

        require_cupy()
        return True
    except Exception:  # noqa: BLE001
        return False


def test_smoke_without_gpu_exits_2_with_one_sentence():
    if _gpu_visible():
        pytest.skip("a CUDA device is visible; this checks the no-GPU path")
    result = CliRunner().invoke(main, ["smoke", "--max-real-kv-sources", "4"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith("kvcanary: error: smoke needs a CUDA GPU with cupy")
    assert "Traceback" not in result.output


def test_smoke_rejects_a_bound_above_64():
    result = CliRunner().invoke(main, ["smoke", "--max-real-kv-sources", "65"])
    assert result.exit_code == 2 and "--max-real-kv-sources" in result.output


BOUNDS = (1, 6)


@pytest.fixture(scope="module")
def smoke_variants():
    """The harness variants the smoke runs launch (the plan's is bound 4's), compiled side by
    side up front (a smoke run is about 0.5 s; a cold compile of each variant 2-3 s)."""
    build_variants([(bound, check) for bound in BOUNDS for check in (False, True)]
                   + [(4, False)])


@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.needs_compiler
def test_smoke_logic_passes_on_the_cpu_kernels(bound, smoke_variants):
    import numpy as np

    report = run_smoke(bound, xp=np, device=CpuKernels(multiprocessor_count=2))
    assert report.ok, "\n".join(report.lines())
    names = [name for name, _, _ in report.checks]
    assert all(any(f"fault {fault}: reported" == n for n in names) for fault in FAULTS)
    assert report.lines()[-1] == "smoke: passed"


class _VerifyForgetsRealKv(CpuKernels):
    """A broken device: verifies without real-KV hashing."""

    def verify(self, context, plan, *, check_expected_token):
        import copy

        from kvcanary.format.consts import RealKvHashMode

        blind = copy.copy(context)
        blind.real_kv_hash_mode = RealKvHashMode.NONE
        super().verify(blind, plan, check_expected_token=check_expected_token)


@pytest.mark.needs_compiler
def test_smoke_fails_when_the_device_misses_a_fault(smoke_variants):
    import numpy as np

    # A bound the passing runs use too: the broken device needs no variant of its own.
    report = run_smoke(BOUNDS[-1], xp=np, device=_VerifyForgetsRealKv(multiprocessor_count=2))
    assert not report.ok
    assert report.lines()[-1] == "smoke: FAILED"


def test_smoke_with_cupy_but_no_driver_says_there_is_no_driver(monkeypatch):
    """CUDA answers "driver version is insufficient" where no driver is loaded at all: the
    message must not read as a call to upgrade."""
    import sys
    import types

    import kvcanary.backends.cuda as cuda

    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                           "for CUDA runtime version")

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_driver))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuda, "_CUPY", None)
    monkeypatch.setattr(cuda, "_MISSING", None)
    result = CliRunner().invoke(main, ["smoke", "--max-real-kv-sources", "4"])
    assert result.exit_code == 2
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert "no NVIDIA driver is loaded here" in line and "numpy backend" in line
