"""Which backend runs: the one resolution of a backend name for the API, the audit and the
campaign.

``numpy`` is the reference (always there); ``cupy`` the CUDA kernels (cupy and a device
needed); ``auto`` is ``cupy`` when cupy sees a CUDA device here, else ``numpy``. Whether a
device is usable is probed once per process (:func:`kvcanary.backends.cuda.require_cupy` keeps the
answer), so resolving again costs nothing."""

from __future__ import annotations

from ..format.errors import CanaryError

BACKENDS = ("auto", "numpy", "cupy")
# The array libraries a resolved backend runs on.
LIBRARIES = ("numpy", "cupy")


def _known(name: str) -> str:
    if name not in BACKENDS:
        raise CanaryError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}",
                          key="backend")
    return name


def cupy_unavailable() -> str | None:
    """Why the CUDA backend cannot run here (cupy missing, no device), or None when it can."""
    from .cuda import unavailable_reason

    return unavailable_reason()


def resolve_backend(name: str) -> str:
    """The backend ``name`` runs on: ``"numpy"`` or ``"cupy"``.

    ``"auto"`` gives ``"cupy"`` when a CUDA device is usable, else ``"numpy"``; ``"cupy"``
    must be usable. Raises ``ValueError`` for any other name, or for ``"cupy"`` without
    cupy or a device (the message says which).

    >>> resolve_backend("numpy")
    'numpy'
    >>> resolve_backend("auto") in LIBRARIES
    True"""
    if _known(name) == "numpy":
        return "numpy"
    why = cupy_unavailable()
    if why is None:
        return "cupy"
    if name == "cupy":
        raise CanaryError(f"backend cupy is not usable: {why}", key="backend")
    return "numpy"


def backend_module(name: str):
    """The module whose ``plan``, ``write`` and ``verify`` run backend ``name`` on
    validated arguments (``auto`` resolved first). ``cupy`` without cupy or a device
    raises :class:`kvcanary.backends.cuda.CudaUnavailable`."""
    if name == "auto":
        name = resolve_backend(name)
    if _known(name) == "numpy":
        from . import reference

        return reference.BACKEND
    from . import cuda

    return cuda.backend()
