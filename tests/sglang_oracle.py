"""SGLang's own KV-canary reference, from its published wheel, as a test oracle.

The wheel is fetched with pip at test time (never vendored: no SGLang code enters this
repository) and only its ``sglang/kernels/ops/kv_canary/*.py`` files are kept, in a
per-user cache, so later runs need no network. Only those modules are imported: the
packages above them are empty stand-ins, and the JIT loader their launchers import at
module level is a stub that refuses to compile (the torch references never call it).

``KVCANARY_SGLANG_VERSION`` picks the version (default :data:`DEFAULT_VERSION`);
``KVCANARY_SGLANG_CACHE`` the cache directory (default ``~/.cache/kvcanary/sglang``).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

DEFAULT_VERSION = "0.5.23"
VERSION_ENV = "KVCANARY_SGLANG_VERSION"
CACHE_ENV = "KVCANARY_SGLANG_CACHE"
PACKAGE = "sglang/kernels/ops/kv_canary"
MODULES = ("consts", "verify", "write", "verify_ref", "write_ref", "plan_ref")
PIP_TIMEOUT_S = 600


class Unavailable(Exception):
    """The oracle cannot be had here; the message says why (tests skip with it)."""


def version() -> str:
    return os.environ.get(VERSION_ENV) or DEFAULT_VERSION


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvcanary" / "sglang")


def obtain(wanted: str) -> Path:
    """The directory holding ``sglang/kernels/ops/kv_canary`` of SGLang ``wanted``:
    from the cache, else downloaded with ``pip download --no-deps`` and cached."""
    target = cache_root() / wanted
    if (target / PACKAGE / "write_ref.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--quiet", f"sglang=={wanted}", "-d", scratch]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"pip download sglang=={wanted} did not finish: {exc}") from exc
        wheels = sorted(Path(scratch).glob("sglang-*.whl"))
        if done.returncode != 0 or not wheels:
            raise Unavailable(f"pip download sglang=={wanted} failed: "
                              f"{(done.stderr or done.stdout).strip()[-400:]}")
        staging = Path(scratch) / "extracted"
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [name for name in wheel.namelist()
                       if name.startswith(PACKAGE + "/") and name.endswith(".py")]
            if not any(name.endswith("/write_ref.py") for name in members):
                raise Unavailable(f"sglang=={wanted} has no {PACKAGE}/write_ref.py")
            wheel.extractall(staging, members)
        try:
            os.replace(staging, target)
        except OSError:  # another run cached it first
            if not (target / PACKAGE / "write_ref.py").is_file():
                raise
    return target


def _package(name: str, path: Path | None = None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)] if path is not None else []
    sys.modules[name] = module
    return module


def _no_jit(*args, **kwargs):
    raise RuntimeError("the SGLang oracle runs the torch references only; no JIT here")


def load(root: Path) -> types.SimpleNamespace:
    """Import the kv_canary modules under ``root``; returns them by short name, with
    ``torch``."""
    existing = sys.modules.get("sglang")
    if existing is not None and getattr(existing, "__kvcanary_oracle__", None) != str(root):
        raise Unavailable("another sglang package is already imported in this process")
    if existing is None:
        top = _package("sglang", root / "sglang")
        top.__kvcanary_oracle__ = str(root)
        _package("sglang.kernels", root / "sglang" / "kernels")
        _package("sglang.kernels.ops", root / "sglang" / "kernels" / "ops")
        _package("sglang.kernels.ops.kv_canary", root / PACKAGE)
        _package("sglang.kernels.jit")
        utils = types.ModuleType("sglang.kernels.jit.utils")
        utils.cache_once = lambda function: function
        utils.load_jit = utils.make_cpp_args = _no_jit
        sys.modules[utils.__name__] = utils
    import torch

    return types.SimpleNamespace(torch=torch, **{
        name: importlib.import_module(f"sglang.kernels.ops.kv_canary.{name}")
        for name in MODULES})


def oracle() -> types.SimpleNamespace:
    """SGLang's kv_canary modules for :func:`version`, or :class:`Unavailable`."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise Unavailable(f"torch is not installed ({exc}); SGLang's reference needs it") from exc
    return load(obtain(version()))
