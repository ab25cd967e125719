"""Shared test set-up, for every folder of the suite (the folders mirror the package):

* the shared helper modules (``builders``, ``oracle``, ``workload``, ``fuzz_support``,
  ``cupy_stub``, ``alias_cases``, ``kernel_harness``, ``interrupt_harness``) and every test folder are
  importable by their plain names from anywhere, whatever pytest's import mode;
* subprocesses the tests start (the CLI, the benchmark scripts) import this checkout's
  kvcanary, installed or not (its root goes first on ``PYTHONPATH``);
* one place decides every skip for what a test needs, one reason each: a test marked
  ``gpu`` runs only where kvcanary's CUDA backend sees a device (skipped with kvcanary's
  reason otherwise), ``needs_cupy`` where cupy imports, ``needs_compiler`` (and every test
  using the ``cpu_kernels`` fixture) where a C++ compiler builds the CPU kernel harness,
  ``needs_nvrtc`` where cuda-core compiles a kernel with NVRTC;
* the run ends with one line per reason of what did not run;
* ``tiny_campaign``: the smallest campaign of each layout, run once a session (the synth pins
  and the campaign's progress and job-count tests read the same run).
"""

import importlib.util
import os
import sys
from collections import Counter

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
for _folder, _dirs, _files in sorted(os.walk(_HERE)):
    _dirs[:] = [d for d in _dirs if not d.startswith((".", "_"))]
    if any(f.startswith("test_") for f in _files) or _folder == _HERE:
        if _folder not in sys.path:
            sys.path.insert(0 if _folder == _HERE else len(sys.path), _folder)

_ROOT = os.path.dirname(_HERE)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _ROOT])


def _no_gpu():
    from kvcanary.backends.cuda import unavailable_reason

    why = unavailable_reason()
    return f"no GPU: {why}" if why else None


def _no_cupy():
    if importlib.util.find_spec("cupy") is None:
        return ("cupy is not installed in this environment: pip install 'kvcanary[cuda13]' "
                "(or [cuda12])")
    return None


def _no_compiler():
    from kernel_harness import compiler

    if compiler() is None:
        return ("no C++ compiler (g++, c++ or clang++) on this machine: the CUDA kernel "
                "source cannot run on the CPU")
    return None


def _no_nvrtc():
    try:
        import cuda.core  # noqa: F401
    except ImportError:
        return ("cuda-core (with cuda-bindings and nvidia-cuda-nvrtc) is not installed: "
                "pip install 'kvcanary[test]'")
    from test_kernels_nvrtc import compile_kernel

    try:
        compile_kernel("plan", None, False, "sm_80")
    except Exception as exc:  # noqa: BLE001 - report why and skip
        return f"NVRTC is not usable here: {type(exc).__name__}: {str(exc)[:200]}"
    return None


# marker -> what decides it (None: available; else the one reason of the skip)
NEEDS = {"gpu": _no_gpu, "needs_cupy": _no_cupy, "needs_compiler": _no_compiler,
         "needs_nvrtc": _no_nvrtc}


def _needs(item) -> set:
    needs = {name for name in NEEDS if item.get_closest_marker(name)}
    if "cpu_kernels" in getattr(item, "fixturenames", ()):
        needs.add("needs_compiler")
    return needs


def pytest_collection_modifyitems(config, items):
    reasons = {}
    for item in items:
        for name in sorted(_needs(item)):
            if name not in reasons:
                reasons[name] = NEEDS[name]()   # decided once, only where a test needs it
            if reasons[name]:
                item.add_marker(pytest.mark.skip(reason=reasons[name]))
                break


TINY_CAMPAIGN = dict(faults_per_kind=2, clean_runs=2, seed=1, backend="numpy", jobs=1)


@pytest.fixture(scope="session")
def tiny_campaign():
    """layout -> (report, progress calls) of ``run_campaign(**TINY_CAMPAIGN, layout=...)``,
    run on first use: 6 s per-token, 14 s paged, which three tests would each pay again."""
    from kvcanary.campaign import run_campaign

    runs = {}

    def get(layout: str):
        if layout not in runs:
            calls = []
            report = run_campaign(**TINY_CAMPAIGN, layout=layout,
                                  progress=lambda phase, done, total: calls.append(
                                      (phase, done, total)))
            runs[layout] = report, calls
        return runs[layout]

    return get


def pytest_terminal_summary(terminalreporter):
    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", "what did not run")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:5d} skipped: {reason}")
