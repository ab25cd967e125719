"""What this installation is and can do (``kvcanary info``)."""

from __future__ import annotations

import importlib.metadata
import platform

import numpy as np

from .. import __version__
from ..format.consts import CANARY_CHAIN_ANCHOR, MAX_REAL_KV_SOURCES, MAX_REAL_KV_SOURCES_LIMIT


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cupy_report() -> tuple[str, str]:
    try:
        import cupy
    except ImportError:
        return "not installed", "none (cupy is not installed)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        if count < 1:
            return cupy.__version__, "none (no CUDA device visible)"
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return cupy.__version__, f"{name} (sm_{props['major']}{props['minor']}, {count} visible)"
    except Exception as exc:
        return cupy.__version__, f"none ({type(exc).__name__}: {exc})"


# The pip wheels that ship NVRTC: CUDA 13's, then CUDA 12's.
NVRTC_WHEELS = ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12")
NVRTC_HINT = "pip install 'kvcanary[cuda13]' (or '[cuda12]') brings it"


def _nvrtc_report() -> str:
    """Where NVRTC, which compiles the kernels, comes from: the library CuPy's own lookup
    (cuda-pathfinder) loads, how it was found (site-packages, conda, CUDA_PATH, system)
    and, for a pip wheel, the wheel and its version; else why none was found."""
    try:
        from cuda import pathfinder
    except ImportError:
        return ("not found (cuda-pathfinder, CuPy's CUDA library lookup, is not installed; "
                f"{NVRTC_HINT})")
    try:
        lib = pathfinder.load_nvidia_dynamic_lib("nvrtc")
    except Exception as exc:  # noqa: BLE001 - DynamicLibNotFoundError or a loader error
        return f"not found ({type(exc).__name__}: {str(exc)[:200]}; {NVRTC_HINT})"
    wheels = [f"{name} {_package_version(name)}" for name in NVRTC_WHEELS
              if _package_version(name) != "not installed"]
    wheel = f", pip {' + '.join(wheels)}" if wheels and lib.found_via == "site-packages" else ""
    return f"{lib.abs_path} (found via {lib.found_via}{wheel})"


def environment_report() -> dict:
    from ..backends.kernel_source import kernel_dir

    cupy_version, gpu = _cupy_report()
    try:
        kernels = str(kernel_dir())
    except FileNotFoundError as exc:
        kernels = str(exc)
    return {
        "kvcanary": __version__,
        "python": platform.python_version(),
        "hash scheme": (
            f"splitmix64_mix3(prev_hash, token, position), anchor {CANARY_CHAIN_ANCHOR:#018x}"
        ),
        "real-KV sources": f"default bound {MAX_REAL_KV_SOURCES}, up to {MAX_REAL_KV_SOURCES_LIMIT}",
        "numpy": np.__version__,
        "cupy": cupy_version,
        "nvrtc": _nvrtc_report(),
        "gpu": gpu,
        "kernel sources": kernels,
        **_kernel_cache_report(),
    }


def _kernel_cache_report() -> dict:
    """The kernel cache folder, and the variants of the default bound (compiled in this
    process or not: cupy caches by source and options, so a variant compiles once per
    machine)."""
    from ..backends.cuda import compiled_variants, kernel_cache_dir, variant_names

    compiled = set(compiled_variants())
    names = variant_names(MAX_REAL_KV_SOURCES)
    return {"kernel cache": kernel_cache_dir(),
            "kernel variants": ", ".join(n + (" (compiled)" if n in compiled else "")
                                         for n in names)}
