"""What the reference backend's compiled paths (numba, where installed) share: compiling
into numba's on-disk cache, and loading compiled kernels once per process. Imports no numba
itself: the kernel modules do, and only they call :func:`compiled`."""

from __future__ import annotations

import sys
import threading


def compiled(function, **options):
    """``numba.njit`` with the on-disk cache, without it where no location is writable."""
    import numba

    try:
        return numba.njit(cache=True, **options)(function)
    except RuntimeError:    # numba: "cannot cache function ...: no locator available"
        return numba.njit(**options)(function)


class LoadOnce:
    """Compiled kernels loaded at first use, once per process (thread-safe).

    ``load()`` imports a kernel module, calls its kernels once with the argument types of
    every later call (so numba compiles them, or reads its cache, then and not inside a
    launch) and returns them; it returns None, or raises, where numba is absent or fails to
    load or compile, and then the numpy path runs. Calling the instance gives what ``load``
    returned, or None on a big-endian host (the kernels read words little-endian)."""

    def __init__(self, load):
        self._load = load
        self._lock = threading.Lock()
        self._tried = False
        self._kernels = None

    def __call__(self):
        if sys.byteorder != "little":
            return None
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        self._kernels = self._load()
                    except Exception:   # absent, built for another numpy, no compiler backend
                        self._kernels = None
                    self._tried = True
        return self._kernels
