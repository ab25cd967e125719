"""SplitMix64 and the chain link, for Python ints and for numpy integer arrays.

The rules of docs/format.md §3-§4, one function each:
  splitmix64(x)         the SplitMix64 finalizer (no increment step)
  splitmix64_mix3(a,b,c) fold a, b, c in that order
  link(prev, tok, pos)  the chain link of a record = mix3(prev_hash, token, position)
All arithmetic is modulo 2**64; int64 values enter as their two's-complement bits.
"""

from __future__ import annotations

import numpy as np

from .errors import CanaryTypeError

from .consts import (
    CANARY_CHAIN_ANCHOR,
    SPLITMIX64_MUL_1,
    SPLITMIX64_MUL_2,
    SPLITMIX64_SHIFT_1,
    SPLITMIX64_SHIFT_2,
    SPLITMIX64_SHIFT_3,
)

_MASK64 = (1 << 64) - 1
_MUL_1 = np.uint64(SPLITMIX64_MUL_1)
_MUL_2 = np.uint64(SPLITMIX64_MUL_2)
_SHIFT_1 = np.uint64(SPLITMIX64_SHIFT_1)
_SHIFT_2 = np.uint64(SPLITMIX64_SHIFT_2)
_SHIFT_3 = np.uint64(SPLITMIX64_SHIFT_3)


def as_u64(values) -> np.ndarray:
    """Integer array (any signedness) as uint64 bits; int64 -1 becomes 0xFFFF_FFFF_FFFF_FFFF."""
    array = np.asarray(values)
    if array.dtype.kind not in "iub":
        raise CanaryTypeError(f"expected an integer array, got dtype {array.dtype}")
    if array.dtype == np.uint64:
        return array
    if array.dtype.itemsize == 8:
        return array.view(np.uint64)
    return array.astype(np.int64).view(np.uint64)


def _splitmix64_int(x: int) -> int:
    x &= _MASK64
    x ^= x >> SPLITMIX64_SHIFT_1
    x = (x * SPLITMIX64_MUL_1) & _MASK64
    x ^= x >> SPLITMIX64_SHIFT_2
    x = (x * SPLITMIX64_MUL_2) & _MASK64
    return x ^ (x >> SPLITMIX64_SHIFT_3)


def splitmix64_inplace(x: np.ndarray) -> np.ndarray:
    """SplitMix64 of a uint64 array, computed in place (the hot path's form)."""
    scratch = x >> _SHIFT_1
    x ^= scratch
    x *= _MUL_1
    np.right_shift(x, _SHIFT_2, out=scratch)
    x ^= scratch
    x *= _MUL_2
    np.right_shift(x, _SHIFT_3, out=scratch)
    x ^= scratch
    return x


def splitmix64(x):
    """SplitMix64 finalizer. ``int -> int``; integer arrays -> new uint64 arrays.

    >>> hex(splitmix64(1))
    '0x5692161d100b05e5'
    """
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return _splitmix64_int(int(x))
    return splitmix64_inplace(as_u64(x).copy())


def mix3_inplace(acc: np.ndarray, b, c) -> np.ndarray:
    """``acc = mix3(acc, b, c)`` for uint64 arrays, in place."""
    splitmix64_inplace(acc)
    acc ^= b
    splitmix64_inplace(acc)
    acc ^= c
    return splitmix64_inplace(acc)


# Elements per in-place block: long arrays are hashed in cache-sized pieces. Read at
# call time, so tests shrink it to cross block edges with small arrays.
BLOCK_ENTRIES = 1 << 16


def link_inplace(prev_hash: np.ndarray, token: np.ndarray, position: np.ndarray) -> np.ndarray:
    """``prev_hash = link(prev_hash, token, position)`` over uint64 arrays, in place,
    block by block so the eight passes of each SplitMix64 stay in cache."""
    for begin in range(0, prev_hash.shape[0], BLOCK_ENTRIES):
        end = begin + BLOCK_ENTRIES
        mix3_inplace(prev_hash[begin:end], token[begin:end], position[begin:end])
    return prev_hash


def splitmix64_mix3(a, b, c):
    """``h = splitmix64(a); h = splitmix64(h ^ b); h = splitmix64(h ^ c)``: a record's chain
    link from its predecessor's link ``a``, its token ``b`` and its position ``c`` (ints, or
    integer arrays broadcast to a new uint64 array)."""
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (a, b, c)):
        h = _splitmix64_int(int(a))
        h = _splitmix64_int(h ^ (int(b) & _MASK64))
        return _splitmix64_int(h ^ (int(c) & _MASK64))
    a64, b64, c64 = np.broadcast_arrays(as_u64(a), as_u64(b), as_u64(c))
    return mix3_inplace(a64.copy(), b64, c64)


CHAIN_HEAD = _splitmix64_int(CANARY_CHAIN_ANCHOR)
"""``H0``: the link of "no predecessor" (``link(-k)`` for every negative index)."""


def link(prev_hash, token, position):
    """The chain link a successor of this record must store as its ``prev_hash``."""
    return splitmix64_mix3(prev_hash, token, position)


def to_signed(value: int) -> int:
    """uint64 bits as the int64 value stored in a canary or violation field."""
    value &= _MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


def to_unsigned(value: int) -> int:
    return int(value) & _MASK64
