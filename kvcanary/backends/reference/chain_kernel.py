"""SplitMix64 and the chain link compiled (numba); imported by :mod:`.chain_compiled` only
where numba is installed, on first use. Compiled once into numba's on-disk cache where
there is a writable one, else once per process."""

from __future__ import annotations

import numpy as np

from ...format.consts import (
    SPLITMIX64_MUL_1,
    SPLITMIX64_MUL_2,
    SPLITMIX64_SHIFT_1,
    SPLITMIX64_SHIFT_2,
    SPLITMIX64_SHIFT_3,
)
from .jit import compiled

MUL_1, MUL_2 = np.uint64(SPLITMIX64_MUL_1), np.uint64(SPLITMIX64_MUL_2)
# uint64 shift counts: numba turns ``uint64 >> int64`` into float64.
SHIFT_1, SHIFT_2 = np.uint64(SPLITMIX64_SHIFT_1), np.uint64(SPLITMIX64_SHIFT_2)
SHIFT_3 = np.uint64(SPLITMIX64_SHIFT_3)


def splitmix_py(x):
    """SplitMix64 of one uint64 scalar."""
    x ^= x >> SHIFT_1
    x *= MUL_1
    x ^= x >> SHIFT_2
    x *= MUL_2
    return x ^ (x >> SHIFT_3)


splitmix = compiled(splitmix_py, inline="always")


def splitmix_rows_py(x):
    """``x[i] = splitmix64(x[i])`` in place."""
    for i in range(x.shape[0]):
        x[i] = splitmix(x[i])


def mix3_rows_py(acc, b, c):
    """``acc[i] = mix3(acc[i], b[i], c[i])`` in place (the chain link's three rounds)."""
    for i in range(acc.shape[0]):
        acc[i] = splitmix(splitmix(splitmix(acc[i]) ^ b[i]) ^ c[i])


splitmix_rows = compiled(splitmix_rows_py, nogil=True, boundscheck=False)
mix3_rows = compiled(mix3_rows_py, nogil=True, boundscheck=False)
