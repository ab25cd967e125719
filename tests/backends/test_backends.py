"""One backend resolution for the API, the audit and the campaign: ``auto``, ``numpy`` and
``cupy`` mean the same everywhere, an unknown name gets the one error text, and the device is
probed once per process whatever resolves it."""

from __future__ import annotations

import re
import sys
import types

import pytest

import kvcanary as kc
from builders import make_context, make_verify_plan
from kvcanary.backends import resolve as backends, cuda, reference
from kvcanary.backends.resolve import backend_module, cupy_unavailable, resolve_backend
from kvcanary.campaign import CampaignError, resolve_backends

UNKNOWN = "kv-canary: backend must be one of auto, numpy, cupy, got 'tpu'"


def test_numpy_is_always_there():
    assert resolve_backend("numpy") == "numpy"
    assert backend_module("numpy") is reference.BACKEND


def test_auto_is_cupy_exactly_where_a_device_is_usable():
    why = cupy_unavailable()
    assert resolve_backend("auto") == ("numpy" if why else "cupy")
    if why:
        assert backend_module("auto") is reference.BACKEND
        with pytest.raises(ValueError, match=f"^kv-canary: backend cupy is not usable: {re.escape(why)}$"):
            resolve_backend("cupy")
        with pytest.raises(cuda.CudaUnavailable):
            backend_module("cupy")
    else:  # pragma: no cover - machines with a GPU
        assert resolve_backend("cupy") == "cupy"


@pytest.mark.parametrize("resolve", [resolve_backend, backend_module])
def test_an_unknown_name_is_refused_with_the_one_text(resolve):
    with pytest.raises(ValueError, match=f"^{re.escape(UNKNOWN)}$"):
        resolve("tpu")


def test_the_api_and_the_campaign_share_the_text():
    with pytest.raises(ValueError, match=f"^{re.escape(UNKNOWN)}$"):
        kc.verify(make_context(), make_verify_plan([1], [0], [-1]), backend="tpu")
    with pytest.raises(CampaignError, match="^--backend must be one of auto, numpy, cupy, got 'tpu'$"):
        resolve_backends("tpu")


def test_the_api_takes_auto():
    context = make_context()
    kc.verify(context, make_verify_plan([1], [0], [-1]), backend="auto")
    assert int(context.kernel_run_counter[0]) == 1


def test_campaign_backends_follow_the_resolution():
    assert resolve_backends("numpy") == (["numpy"], {"cupy": "not requested (--backend numpy)"})
    why = cupy_unavailable()
    if why:
        assert resolve_backends("auto") == (["numpy"], {"cupy": why})
        with pytest.raises(CampaignError, match="^--backend cupy is not usable: "):
            resolve_backends("cupy")
    else:  # pragma: no cover - machines with a GPU
        assert resolve_backends("auto") == (["numpy", "cupy"], {})
        assert resolve_backends("cupy") == (["cupy"], {"numpy": "not requested (--backend cupy)"})


@pytest.mark.parametrize("count", [0, 1])
def test_resolving_again_does_not_probe_again(monkeypatch, count):
    probes = []
    runtime = types.SimpleNamespace(getDeviceCount=lambda: probes.append(1) or count)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(cuda, "_CUPY", None)
    monkeypatch.setattr(cuda, "_MISSING", None)
    expected = "cupy" if count else "numpy"
    for _ in range(3):
        assert resolve_backend("auto") == expected
        assert (backends.cupy_unavailable() is None) == bool(count)
    assert probes == [1]
