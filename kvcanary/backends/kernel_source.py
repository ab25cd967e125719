"""Where the CUDA C sources live: inside the installed package (``kvcanary/kernels``,
shipped in the wheel) or beside the package in a checkout (``kernels/``)."""

from __future__ import annotations

from pathlib import Path

from ..format.errors import Prefixed


class KernelSourcesMissing(Prefixed, FileNotFoundError):
    """The CUDA C sources are not where the package looks (a broken install)."""


def kernel_dir() -> Path:
    package = Path(__file__).resolve().parents[1]   # kvcanary/, this file is in backends/
    for candidate in (package / "kernels", package.parent / "kernels"):
        if (candidate / "kvc_consts.cuh").is_file():
            return candidate
    raise KernelSourcesMissing(
        "CUDA kernel sources not found (looked in "
        f"{package / 'kernels'} and {package.parent / 'kernels'}); reinstall kvcanary"
    )


def read_source(name: str) -> str:
    return (kernel_dir() / name).read_text(encoding="utf-8")
