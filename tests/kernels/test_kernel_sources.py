"""House rules of the C++ sources (kernels/ and the CPU harness): each starts with the
project's license identifier, and no kernel body pulls a namespace in with ``using
namespace`` (a kernel names what it calls from ``kvc::``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcanary.backends.kernel_source import kernel_dir

HARNESS = Path(__file__).resolve().parents[1] / "kernel_harness"
SOURCES = sorted([*kernel_dir().glob("*.cu*"), *HARNESS.glob("*.cpp"), *HARNESS.glob("*.h")])
LICENSE_LINE = "// SPDX-License-Identifier: Apache-2.0"
USING_NAMESPACE = re.compile(r"^\s*using\s+namespace\b", re.MULTILINE)


def test_the_sources_are_found():
    names = {path.name for path in SOURCES}
    assert {"kvc_plan.cu", "kvc_write.cu", "kvc_verify.cu", "kvc_common.cuh",
            "harness.cpp", "cuda_shim.h"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_each_source_starts_with_the_license_identifier(path):
    assert path.read_text(encoding="utf-8").splitlines()[0] == LICENSE_LINE


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_using_namespace(path):
    lines = [i + 1 for i, line in enumerate(path.read_text(encoding="utf-8").splitlines())
             if USING_NAMESPACE.match(line)]
    assert not lines, f"{path.name}: using namespace at line(s) {lines}"
