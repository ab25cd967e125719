"""The API fuzz suite (test_fuzz_api.py) again, on a smaller budget, with the kernels built
under AddressSanitizer and UBSan (no recovery) in a subprocess, as
test_kernels_cpu_sanitizers.py does: a stray read or write, a misaligned load or signed
overflow inside a kernel aborts the run, even where guard bytes would not notice it."""

import os

import pytest
from test_kernels_cpu_sanitizers import run_pytest_under_sanitizers

pytestmark = pytest.mark.fuzz

EXAMPLES = os.environ.get("KVCANARY_FUZZ_SANITIZER_EXAMPLES", "100")


@pytest.mark.skipif(os.environ.get("KVCANARY_HARNESS_SANITIZE") == "1",
                    reason="already running under the sanitizers")
@pytest.mark.needs_compiler
def test_api_fuzz_under_address_and_undefined_sanitizers():
    run_pytest_under_sanitizers(["api/test_fuzz_api.py"], KVCANARY_FUZZ_EXAMPLES=EXAMPLES)
