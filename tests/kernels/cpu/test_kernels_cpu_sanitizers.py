"""The out-of-range and property tests again, with the harness built under
AddressSanitizer and UBSan (-fsanitize=address,undefined, no recovery), in a subprocess:
ASan's runtime must be preloaded before Python starts when the library comes in through
ctypes. Any stray read or write, or undefined behaviour, aborts that run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_harness import SANITIZE_FLAGS, build_variants, compiler

TESTS = Path(__file__).resolve().parents[2]
SUBSET = ["kernels/cpu/test_kernels_cpu_out_of_range.py",
          "kernels/cpu/test_kernels_cpu_properties.py", "kernels/cpu/test_kernels_cpu_plan.py",
          "reference/test_paged_plan.py", "reference/test_ring_saturation.py"]


def asan_runtime(cxx: str) -> str | None:
    out = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


def run_pytest_under_sanitizers(test_files, **extra_env) -> None:
    """Run the given test files in a pytest subprocess with the harness built under
    ASan/UBSan and the ASan runtime preloaded; fail with the sanitizer's report."""
    cxx = compiler()   # the caller is marked needs_compiler
    runtime = asan_runtime(cxx)
    if runtime is None:
        pytest.skip(f"{cxx} has no AddressSanitizer runtime (libasan.so)")
    env = dict(os.environ, KVCANARY_HARNESS_SANITIZE="1", LD_PRELOAD=runtime,
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", **extra_env)
    # The variants the runs launch (bound 4, and the property tests' 1 and 8, each with and
    # without the token check), compiled side by side first; one missing here is still
    # compiled by the run itself.
    build_variants([(bound, check) for bound in (1, 4, 8) for check in (False, True)],
                   SANITIZE_FLAGS)
    result = subprocess.run(
        # -s: a sanitizer exits the process from inside a test; with pytest's fd capture on,
        # its report would be lost with the test's captured output.
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-x",
         *[str(TESTS / name) for name in test_files]],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600)
    # The sanitizer's report leads stderr; Python's fatal-error trace may follow it.
    report = result.stdout[-3000:] + result.stderr[:6000]
    assert result.returncode == 0, report
    assert "passed" in result.stdout and "ERROR: AddressSanitizer" not in report


@pytest.mark.needs_compiler
def test_subset_under_address_and_undefined_sanitizers():
    run_pytest_under_sanitizers(SUBSET)
