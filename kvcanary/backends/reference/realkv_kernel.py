"""The compiled real-KV fold kernel (numba); imported by :mod:`.realkv_compiled` only where
numba is installed, on first use. Compiled once into numba's on-disk cache where there is a
writable one, else once per process."""

from __future__ import annotations

import numba
import numpy as np

from ...format.consts import (
    SPLITMIX64_MUL_1,
    SPLITMIX64_MUL_2,
    SPLITMIX64_SHIFT_1,
    SPLITMIX64_SHIFT_2,
    SPLITMIX64_SHIFT_3,
)

# Slots the kernel folds side by side: independent dependency chains the CPU overlaps (16
# measured fastest on an AMD EPYC host; one slot at a time is three times slower).
LANES = 16

MUL_1, MUL_2 = np.uint64(SPLITMIX64_MUL_1), np.uint64(SPLITMIX64_MUL_2)
# uint64 shift counts: numba turns ``uint64 >> int64`` into float64.
SHIFT_1, SHIFT_2 = np.uint64(SPLITMIX64_SHIFT_1), np.uint64(SPLITMIX64_SHIFT_2)
SHIFT_3 = np.uint64(SPLITMIX64_SHIFT_3)


def compiled(function, **options):
    """``numba.njit`` with the on-disk cache, without it where no location is writable."""
    try:
        return numba.njit(cache=True, **options)(function)
    except RuntimeError:    # numba: "cannot cache function ...: no locator available"
        return numba.njit(**options)(function)


def fold_word_py(acc, word):
    """``splitmix64(acc ^ word)`` on uint64 scalars."""
    x = acc ^ word
    x ^= x >> SHIFT_1
    x *= MUL_1
    x ^= x >> SHIFT_2
    x *= MUL_2
    return x ^ (x >> SHIFT_3)


fold_word = compiled(fold_word_py, inline="always")


def fold_rows_py(words, row_words, page_size, token_words, read_words, slots, out):
    """``out[i]`` = the fold of the first ``read_words`` words of slot ``slots[i]``, where
    ``words`` is the source as one uint64 run (row ``r`` starts at word ``r * row_words``,
    slot ``s`` at ``(s // page_size) * row_words + (s % page_size) * token_words``). Every
    slot must lie inside the source: nothing is bounds-checked."""
    n = slots.shape[0]
    whole = n - n % LANES
    acc = np.zeros(LANES, np.uint64)
    start = np.zeros(LANES, np.int64)
    for base in range(0, whole, LANES):
        for t in range(LANES):
            s = slots[base + t]
            start[t] = (s // page_size) * row_words + (s % page_size) * token_words
            acc[t] = 0
        for w in range(read_words):
            for t in range(LANES):
                acc[t] = fold_word(acc[t], words[start[t] + w])
        for t in range(LANES):
            out[base + t] = acc[t]
    for i in range(whole, n):
        s = slots[i]
        first = (s // page_size) * row_words + (s % page_size) * token_words
        x = np.uint64(0)
        for w in range(read_words):
            x = fold_word(x, words[first + w])
        out[i] = x


fold_rows = compiled(fold_rows_py, nogil=True, boundscheck=False)
