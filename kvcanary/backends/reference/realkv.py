"""The real-KV fingerprint (docs/format.md §5), vectorised over slots.

  fold_source(src, s)   fold each 8-byte little-endian word of the slot's effective bytes
  real_kv_hash(s)       fold the per-source results in source order
  outside a source      kvcanary extension: a slot whose page lies past a source's rows has
                        no bytes to fold; it hashes to 0 and is never read

Where numba is installed, each source's fold runs compiled (:mod:`.realkv_compiled`: the
same words read in place, a few times faster); the numpy fold here is the rule and the path
without it.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ...format.consts import RealKvHashMode
from ...format.hashing import splitmix64_inplace
from . import chain_compiled, realkv_compiled

# Slots hashed per gather: keeps the temporary byte copy (chunk x read bytes) and the
# fold's passes over it in cache. Read at call time, so tests shrink it to cross chunk
# edges with small buffers.
CHUNK_SLOTS = 1 << 13
# Bytes gathered per chunk when several sources fold together (one engine's K and V of
# every layer): fewer slots per chunk, so the temporary copy stays this size.
CHUNK_BYTES = 1 << 25


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
    if mode == RealKvHashMode.NONE or not sources:
        return np.zeros(slots.shape[0], dtype=bool)
    outside = slots >= sources[0].num_slots
    for source in sources[1:]:
        outside |= slots >= source.num_slots
    return outside


def fold_sources(sources, slots: np.ndarray, num_bytes: int) -> np.ndarray:
    """``uint64[len(sources), n]``: :func:`fold_source` of each source (all read ``num_bytes``
    per slot), folded side by side: one pass per word column for all of them, not one per
    source, so many small sources cost about what one large one does."""
    if len(sources) == 1:       # one source: its words fold in place, with no transpose
        return fold_source(sources[0], slots, num_bytes)[None, :]
    # [source, word, slot]: each source's words transposed once, so every pass of the fold
    # reads one contiguous run per source.
    words = np.empty((len(sources), num_bytes // 8, slots.shape[0]), dtype=np.uint64)
    for row, source in enumerate(sources):
        words[row] = np.ascontiguousarray(slot_bytes(source, slots, num_bytes)).view("<u8").T
    acc = np.zeros((len(sources), slots.shape[0]), dtype=np.uint64)
    for column in range(words.shape[1]):
        acc ^= words[:, column]
        splitmix64_inplace(acc)
    return acc


def real_kv_hash(sources, mode: RealKvHashMode, slots: np.ndarray,
                 outside: np.ndarray | None = None) -> np.ndarray:
    """uint64 fingerprint per slot; 0 when the mode is NONE or there are no sources, and
    for a slot outside a source (whose bytes are then not read). ``outside``: the slots'
    :func:`outside_sources`, where the caller found it already (for its reports)."""
    slots = np.asarray(slots, dtype=np.int64)
    if mode == RealKvHashMode.NONE or not sources:
        return np.zeros(slots.shape[0], dtype=np.uint64)
    if outside is None:
        outside = outside_sources(sources, mode, slots)
    if outside.any():
        result = np.zeros(slots.shape[0], dtype=np.uint64)
        inside = (~outside).nonzero()[0]
        result[inside] = hash_inside(sources, mode, slots[inside])
        return result
    return hash_inside(sources, mode, slots)


def hash_inside(sources, mode: RealKvHashMode, slots: np.ndarray) -> np.ndarray:
    """:func:`real_kv_hash` of slots that lie inside every source, under a mode other than
    NONE: the launches, which find the slots outside a source for their reports anyway,
    hash the others here."""
    slots = np.asarray(slots, dtype=np.int64)
    widths = [source.effective_read_bytes(mode) for source in sources]
    compiled = compiled_hash(sources, widths, slots)
    if compiled is not None:
        return compiled
    result = np.zeros(slots.shape[0], dtype=np.uint64)
    groups = {}     # read bytes -> indices of the sources that read that many
    for index, width in enumerate(widths):
        groups.setdefault(width, []).append(index)
    chunk_slots = max(1, min(CHUNK_SLOTS, CHUNK_BYTES // max(1, sum(widths))))
    for begin in range(0, slots.shape[0], chunk_slots):
        chunk = slots[begin:begin + chunk_slots]
        acc = result[begin:begin + chunk_slots]
        folded = [None] * len(sources)
        for width, members in groups.items():
            rows = fold_sources([sources[i] for i in members], chunk, width)
            for row, index in enumerate(members):
                folded[index] = rows[row]
        for source_fold in folded:     # in source order
            acc ^= source_fold
            splitmix64_inplace(acc)
    return result


def compiled_hash(sources, widths, slots: np.ndarray):
    """:func:`hash_inside` by the compiled fold (a new array), or None where that does not
    apply to every source."""
    if not sources:     # nothing to fold: every hash is 0
        return np.zeros(slots.shape[0], dtype=np.uint64)
    folds = []
    for source, width in zip(sources, widths):
        fold = realkv_compiled.fold_source(source, slots, width)
        if fold is None:
            return None
        folds.append(fold)
    result = folds[0]       # 0 ^ the first fold: the fold itself, folded in place
    chain_compiled.splitmix64_inplace(result)
    for source_fold in folds[1:]:     # in source order
        result ^= source_fold
        chain_compiled.splitmix64_inplace(result)
    return result
