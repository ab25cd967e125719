"""The API fuzz suite (test_fuzz_api.py) again, on a smaller budget, with the kernels built
under AddressSanitizer and UBSan (no recovery) in a subprocess, as
test_kernels_cpu_sanitizers.py does: a stray read or write, a misaligned load or signed
overflow inside a kernel aborts the run, even where guard bytes would not notice it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_harness import compiler
from kernel_harness.fixtures import NO_COMPILER
from test_kernels_cpu_sanitizers import asan_runtime

pytestmark = pytest.mark.fuzz

TESTS = Path(__file__).resolve().parent
EXAMPLES = os.environ.get("KVCANARY_FUZZ_SANITIZER_EXAMPLES", "100")


@pytest.mark.skipif(os.environ.get("KVCANARY_HARNESS_SANITIZE") == "1",
                    reason="already running under the sanitizers")
def test_api_fuzz_under_address_and_undefined_sanitizers():
    cxx = compiler()
    if cxx is None:
        pytest.skip(NO_COMPILER)
    runtime = asan_runtime(cxx)
    if runtime is None:
        pytest.skip(f"{cxx} has no AddressSanitizer runtime (libasan.so)")
    env = dict(os.environ, KVCANARY_HARNESS_SANITIZE="1", LD_PRELOAD=runtime,
               KVCANARY_FUZZ_EXAMPLES=EXAMPLES,
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    result = subprocess.run(
        # -s: a sanitizer exits the process from inside a test; with pytest's fd capture on,
        # its report would be lost with the test's captured output.
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-x",
         str(TESTS / "test_fuzz_api.py")],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600)
    # The sanitizer's report leads stderr; Python's fatal-error trace may follow it.
    report = result.stdout[-3000:] + result.stderr[:6000]
    assert result.returncode == 0, report
    assert "passed" in result.stdout and "ERROR: AddressSanitizer" not in report
    assert "runtime error" not in report
