"""Shared test set-up, for every folder of the suite (the folders mirror the package):

* the shared helper modules (``builders``, ``oracle``, ``workload``, ``fuzz_support``,
  ``cupy_stub``, ``kernel_harness``, ``interrupt_harness``) and every test folder are
  importable by their plain names from anywhere, whatever pytest's import mode;
* subprocesses the tests start (the CLI, the benchmark scripts) import this checkout's
  kvcanary, installed or not (its root goes first on ``PYTHONPATH``);
* one place decides the GPU skip: a test marked ``gpu`` runs only where kvcanary's CUDA
  backend sees a device, and is skipped with kvcanary's reason otherwise;
* the run ends with one line per reason of what did not run.
"""

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


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    from kvcanary.cuda import unavailable_reason

    why = unavailable_reason()
    if why:
        skip = pytest.mark.skip(reason=f"no GPU: {why}")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", "what did not run")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:5d} skipped: {reason}")
