"""SplitMix64 and the chain link of the reference launches, compiled by numba where numba is
installed (:mod:`.chain_kernel`), else numpy's (:mod:`kvcanary.format.hashing`).

Same rounds, same result: what differs is the work. numpy runs each of SplitMix64's seven
steps as one pass over the array, 23 passes for a chain link, and a decode step's arrays
are short (a few dozen to a few thousand entries), so each pass costs about its call; the
compiled loop makes one call of the whole link. A test checks both give the same values.

  splitmix64_inplace(x)   SplitMix64 of a uint64 array, in place
  mix3_inplace(a, b, c)   a = mix3(a, b, c) for uint64 arrays of one length, in place
"""

from __future__ import annotations

import numpy as np

from ...format import hashing
from .jit import LoadOnce

# Read at call time: tests turn it off to run numpy's rounds with numba installed.
ENABLED = True


def _load():
    """``(splitmix_rows, mix3_rows)`` compiled for the launches' argument types."""
    from . import chain_kernel
    x = np.zeros(2, dtype=np.uint64)
    strided = np.zeros((2, 4), dtype=np.int64)[:, 0].view(np.uint64)
    chain_kernel.splitmix_rows(x)
    chain_kernel.mix3_rows(x, x, x)
    chain_kernel.mix3_rows(x, strided, strided)     # record columns: strided views
    return chain_kernel.splitmix_rows, chain_kernel.mix3_rows


_kernels = LoadOnce(_load)


def kernels():
    """The compiled loops, loaded once per process; None where this path does not apply."""
    return _kernels() if ENABLED else None


def _fits(*arrays) -> bool:
    """One-dimensional uint64 numpy arrays of one length (what the loops take)."""
    length = arrays[0].shape
    for a in arrays:    # a loop, not all() of a generator: called a few times every launch
        if type(a) is not np.ndarray or a.dtype != np.uint64 or a.ndim != 1 \
                or a.shape != length:
            return False
    return True


def splitmix64_inplace(x: np.ndarray) -> np.ndarray:
    """:func:`kvcanary.format.hashing.splitmix64_inplace`, compiled where it can be."""
    loops = kernels()
    if loops is None or not _fits(x) or not x.flags.writeable:
        return hashing.splitmix64_inplace(x)
    loops[0](x)
    return x


def mix3_inplace(acc: np.ndarray, b, c) -> np.ndarray:
    """:func:`kvcanary.format.hashing.mix3_inplace`, compiled where it can be."""
    loops = kernels()
    if loops is None or not _fits(acc, b, c) or not acc.flags.writeable:
        return hashing.mix3_inplace(acc, b, c)
    loops[1](acc, b, c)
    return acc


def link_inplace(prev_hash: np.ndarray, token: np.ndarray, position: np.ndarray) -> np.ndarray:
    """:func:`kvcanary.format.hashing.link_inplace`, compiled where it can be (one pass: the
    compiled rounds need no blocks to stay in cache)."""
    loops = kernels()
    if loops is None or not _fits(prev_hash, token, position) or not prev_hash.flags.writeable:
        return hashing.link_inplace(prev_hash, token, position)
    loops[1](prev_hash, token, position)
    return prev_hash
