"""Kernel variants have readable names (in compile errors, smoke output and ``kvcanary info``),
the compile options do not depend on where kvcanary is installed, and the CUDA backend checks
for a device once per process, not per launch."""

from __future__ import annotations

import sys
import types

import pytest

from kvcanary.backends import cuda
from kvcanary.backends.cuda import launch as L
from kvcanary.tools.info import environment_report


def test_variant_names():
    assert L.variant_name("verify", 4, True) == "verify_n4_tok1"
    assert L.variant_name("verify", 16, False) == "verify_n16_tok0"
    assert L.variant_name("write", 4) == "write_n4"
    assert L.variant_name("plan", None) == "plan"
    assert cuda.variant_names(4) == ["verify_n4_tok0", "verify_n4_tok1", "write_n4", "plan"]


def test_compile_options_are_path_free():
    options = [L.compile_options(k, 4, c) for k, c in cuda.VARIANTS]
    assert not any(o.startswith("-I") or "/" in o for opts in options for o in opts)
    # No include path is needed: every local header is inlined into the code.
    assert all('#include "' not in L.kernel_source(k) for k in L.KERNEL_FILES)


def test_info_shows_the_kernel_cache_and_the_variants(monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", "/somewhere/kernel-cache")
    report = environment_report()
    assert report["kernel cache"] == "/somewhere/kernel-cache"
    assert report["kernel variants"].split(", ") == cuda.variant_names(4)


def test_a_device_is_counted_once_per_process(monkeypatch):
    counts = []
    runtime = types.SimpleNamespace(getDeviceCount=lambda: counts.append(1) or 1)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuda, "_CUPY", None)
    monkeypatch.setattr(cuda, "_MISSING", None)
    assert cuda.require_cupy() is fake and cuda.require_cupy() is fake
    assert cuda.unavailable_reason() is None
    assert counts == [1]


def test_a_missing_device_is_probed_once_per_process(monkeypatch):
    counts = []

    def no_device():
        counts.append(1)
        return 0

    runtime = types.SimpleNamespace(getDeviceCount=no_device)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=runtime)))
    monkeypatch.setattr(cuda, "_CUPY", None)
    monkeypatch.setattr(cuda, "_MISSING", None)
    for _ in range(3):
        with pytest.raises(cuda.CudaUnavailable, match="cupy sees no CUDA device"):
            cuda.require_cupy()
    assert cuda.unavailable_reason() == "cupy sees no CUDA device"
    assert counts == [1]


def test_a_compile_error_names_the_variant(monkeypatch):
    class Broken:
        def __init__(self, **kwargs):
            raise ValueError("error: expected a ';'")

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=Broken))
    L.module.cache_clear()
    with pytest.raises(RuntimeError, match=r"kernel variant verify_n4_tok1 did not compile"):
        L.module("verify", 4, True)
    L.module.cache_clear()


def test_packing_the_sources_does_not_check_their_count_again(monkeypatch):
    """The launch's validate checks the source count; packing the descriptors for each of a
    write's kernels does not repeat it."""
    import numpy as np

    import kvcanary as kc
    from kvcanary.model import types as T

    calls = []
    counter = lambda *a, **k: calls.append(a)  # noqa: E731
    monkeypatch.setattr(T, "check_source_count", counter)
    monkeypatch.setattr(L, "check_source_count", counter, raising=False)  # an imported copy
    ctx = kc.CanaryContext(np.zeros((8, kc.CANARY_SLOT_BYTES), np.uint8),
                           kernel_kind=kc.LaunchTag.TAIL_K_FULL,
                           violation_log=kc.ViolationLog.allocate(4),
                           slot_run_counter=np.zeros(1, np.int64),
                           kernel_run_counter=np.zeros(1, np.int64))
    L.pack_sources(ctx)
    assert calls == []
    ctx.validate_sources()
    assert len(calls) == 1
