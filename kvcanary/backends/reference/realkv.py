"""The real-KV fingerprint (docs/format.md §5), vectorised over slots.

  fold_source(src, s)   fold each 8-byte little-endian word of the slot's effective bytes
  real_kv_hash(s)       fold the per-source results in source order
  outside a source      kvcanary extension: a slot whose page lies past a source's rows has
                        no bytes to fold; it hashes to 0 and is never read
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ...format.consts import RealKvHashMode
from ...format.hashing import splitmix64_inplace

# Slots hashed per gather: keeps the temporary byte copy (chunk x read bytes) and the
# fold's passes over it in cache. Read at call time, so tests shrink it to cross chunk
# edges with small buffers.
CHUNK_SLOTS = 1 << 13


def slot_bytes(source, slots: np.ndarray, num_bytes: int) -> np.ndarray:
    """``uint8[n, num_bytes]``: the leading bytes of each slot in ``source``."""
    rows = source.tensor
    paged = as_strided(
        rows,
        shape=(rows.shape[0], source.page_size, source.num_bytes_per_token),
        strides=(rows.strides[0], source.num_bytes_per_token, 1),
        writeable=False,
    )
    return paged[slots // source.page_size, slots % source.page_size, :num_bytes]


def fold_words(acc: np.ndarray, words: np.ndarray) -> np.ndarray:
    """``acc = splitmix64(acc ^ w)`` for each word column ``w`` in order, in place."""
    for column in range(words.shape[1]):
        acc ^= words[:, column]
        splitmix64_inplace(acc)
    return acc


def fold_source(source, slots: np.ndarray, num_bytes: int) -> np.ndarray:
    words = np.ascontiguousarray(slot_bytes(source, slots, num_bytes)).view("<u8")
    return fold_words(np.zeros(slots.shape[0], dtype=np.uint64), words)


def outside_sources(sources, mode: RealKvHashMode, slots: np.ndarray) -> np.ndarray:
    """bool per slot: hashing is on and the slot's page lies past some source's rows."""
    slots = np.asarray(slots, dtype=np.int64)
    outside = np.zeros(slots.shape[0], dtype=bool)
    if mode != RealKvHashMode.NONE:
        for source in sources:
            outside |= slots >= source.num_slots
    return outside


def real_kv_hash(sources, mode: RealKvHashMode, slots: np.ndarray) -> np.ndarray:
    """uint64 fingerprint per slot; 0 when the mode is NONE or there are no sources, and
    for a slot outside a source (whose bytes are then not read)."""
    slots = np.asarray(slots, dtype=np.int64)
    result = np.zeros(slots.shape[0], dtype=np.uint64)
    if mode == RealKvHashMode.NONE or not sources:
        return result
    inside = np.flatnonzero(~outside_sources(sources, mode, slots))
    if inside.size < slots.size:
        result[inside] = real_kv_hash(sources, mode, slots[inside])
        return result
    for begin in range(0, slots.shape[0], CHUNK_SLOTS):
        chunk = slots[begin:begin + CHUNK_SLOTS]
        acc = result[begin:begin + CHUNK_SLOTS]
        for source in sources:
            acc ^= fold_source(source, chunk, source.effective_read_bytes(mode))
            splitmix64_inplace(acc)
    return result
