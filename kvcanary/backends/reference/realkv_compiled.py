"""The real-KV fold of :mod:`.realkv`, compiled by numba where numba is installed.

Same words, same order, same result: each slot's first ``num_bytes`` bytes folded as
little-endian 8-byte words, ``acc = splitmix64(acc ^ w)`` from ``acc = 0``. What differs is
the work: the words are read in place from the source's rows (no gathered copy, no
transpose in memory) and each word costs its nine integer operations once, in vector
registers, ``realkv_kernel.LANES`` slots to a vector and ``realkv_kernel.BLOCK`` to a pass
(see that module). The numpy fold of :mod:`.realkv` stays the statement of the rule and the
path without numba; a test checks both give the same hashes.

  fold_source(src, s, n)  uint64 per slot, or None where this path does not apply (numba
                          missing or failing to load, ``ENABLED`` off, a big-endian host,
                          a source that is not a numpy array)
"""

from __future__ import annotations

import numpy as np

from ...model.arrays import data_address
from .jit import LoadOnce

# Read at call time: tests turn it off to run the numpy fold with numba installed.
ENABLED = True


def _load():
    from . import realkv_kernel
    words = np.zeros(2, dtype=np.uint64)
    words.flags.writeable = False       # the argument types of every later call
    realkv_kernel.fold_rows(words, 2, 1, 2, 2, np.zeros(1, dtype=np.int64),
                            np.empty(1, dtype=np.uint64))
    return realkv_kernel.fold_rows


_kernel = LoadOnce(_load)


def kernel():
    """The compiled kernel, loaded (and compiled, or read from numba's cache) once per
    process; None where this path does not apply."""
    return _kernel() if ENABLED else None


def source_words(source):
    """The source's rows as one uint64 array from row 0 to the end of the last row's slots
    (the bytes between rows are spanned, never read); None where the layout does not allow
    that view (not a numpy array, unaligned, no rows). Built from an array interface of its
    own (:class:`_RowSpan`): ``as_strided`` cost a few times more, every launch."""
    rows = source.tensor
    if not isinstance(rows, np.ndarray) or rows.shape[0] == 0:
        return None
    stride = int(rows.strides[0])    # a multiple of 16, as the slot bytes are
    used = source.page_size * source.num_bytes_per_token
    address = data_address(rows)
    if address % 8 or stride % 8 or stride <= 0 or rows.shape[1] < used:
        return None
    span = (rows.shape[0] - 1) * stride + used     # a multiple of 8: stride and used are
    return np.asarray(_RowSpan(rows, address, span // 8))


class _RowSpan:
    """A read-only uint64 run of ``words`` words from ``address``, inside ``rows`` (numpy's
    array interface protocol); the array numpy makes of it keeps it, and so ``rows``, as its
    base while the array lives."""

    __slots__ = ("__array_interface__", "rows")

    def __init__(self, rows: np.ndarray, address: int, words: int):
        self.rows = rows
        self.__array_interface__ = {"data": (address, True), "shape": (words,),
                                    "typestr": "<u8", "version": 3}


def fold_source(source, slots: np.ndarray, num_bytes: int):
    """``uint64[n]``: each slot's fold of its first ``num_bytes`` bytes in ``source`` (the
    numpy fold's result), or None where this path does not apply. ``slots`` lie inside the
    source (the kernel reads without bounds checks: a slot outside is refused here)."""
    fold_rows = kernel()
    words = None if fold_rows is None else source_words(source)
    if words is None:
        return None
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= source.num_slots):
        return None
    out = np.empty(slots.shape[0], dtype=np.uint64)
    fold_rows(words, int(source.tensor.strides[0]) // 8, source.page_size,
              source.num_bytes_per_token // 8, num_bytes // 8, slots, out)
    return out
