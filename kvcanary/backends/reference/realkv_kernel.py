"""The compiled real-KV fold kernel (numba); imported by :mod:`.realkv_compiled` only where
numba is installed, on first use. Compiled once into numba's on-disk cache where there is a
writable one, else once per process.

Each slot's words form one dependency chain (``acc = splitmix64(acc ^ word)``), so a slot
cannot be split; slots side by side can. The kernel folds ``LANES`` slots per SIMD vector
of ``uint64[LANES]`` and ``BLOCK`` slots (several vectors, independent chains the CPU
overlaps) per pass. A slot's words are contiguous, so a vector cannot load "word ``w`` of
eight slots" in one go: it loads eight words of each of eight slots (eight contiguous
loads) and transposes that 8 x 8 block in registers, then folds its eight columns in
order. The vector code is LLVM IR (``numba.extending.intrinsic``): LLVM lowers it to the
host's vector instructions (AVX-512's 64-bit multiply where there is one) or to scalar
code, with the same result everywhere."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

from ...format.consts import (
    SPLITMIX64_MUL_1,
    SPLITMIX64_MUL_2,
    SPLITMIX64_SHIFT_1,
    SPLITMIX64_SHIFT_2,
    SPLITMIX64_SHIFT_3,
)
from .jit import compiled

# Slots per vector (a 512-bit register of uint64), and per pass: four vectors, as their
# chains then hide the multiply's latency (measured on an AMD EPYC host: 8 slots per pass
# fold at 1.5 cycles a word, 32 at 1.2; the scalar fold of 16 slots side by side took 4.5).
LANES = 8
BLOCK = 4 * LANES

_I32, _I64 = ir.IntType(32), ir.IntType(64)
_VECTOR = ir.VectorType(_I64, LANES)


def _splat(value: int):
    return ir.Constant(_VECTOR, [ir.Constant(_I64, value)] * LANES)


def _fold_vector(builder, acc, words):
    """``splitmix64(acc ^ words)``, lane by lane."""
    x = builder.xor(acc, words)
    x = builder.xor(x, builder.lshr(x, _splat(SPLITMIX64_SHIFT_1)))
    x = builder.mul(x, _splat(SPLITMIX64_MUL_1))
    x = builder.xor(x, builder.lshr(x, _splat(SPLITMIX64_SHIFT_2)))
    x = builder.mul(x, _splat(SPLITMIX64_MUL_2))
    return builder.xor(x, builder.lshr(x, _splat(SPLITMIX64_SHIFT_3)))


def _shuffle(builder, x, y, picks):
    """Lanes ``picks`` of ``x`` (0-7) and ``y`` (8-15)."""
    return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, LANES), picks))


def _transpose(builder, rows):
    """``columns[w][t] = rows[t][w]`` for eight rows of eight words: three rounds of
    pairwise shuffles (pairs of words, then of two words, then of four)."""
    even, odd = [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15]
    pairs = []
    for t in range(0, LANES, 2):
        pairs += [_shuffle(builder, rows[t], rows[t + 1], even),
                  _shuffle(builder, rows[t], rows[t + 1], odd)]
    low, high = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    quads = [None] * LANES      # quads[q + w]: words w and w + 4 of rows q..q+3
    for q in (0, 4):
        e, o = pairs[q], pairs[q + 1]           # rows q, q+1: even words, odd words
        e2, o2 = pairs[q + 2], pairs[q + 3]     # rows q+2, q+3
        quads[q + 0], quads[q + 2] = _shuffle(builder, e, e2, low), _shuffle(builder, e, e2, high)
        quads[q + 1], quads[q + 3] = _shuffle(builder, o, o2, low), _shuffle(builder, o, o2, high)
    first, second = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    columns = [None] * LANES
    for w in range(4):
        columns[w] = _shuffle(builder, quads[w], quads[w + 4], first)
        columns[w + 4] = _shuffle(builder, quads[w], quads[w + 4], second)
    return columns


def _fold_slots_intrinsic(vectors: int):
    """An intrinsic ``fold(words, starts, read_words, out)``: for each ``t`` below
    ``vectors * LANES``, ``out[t]`` = the fold of ``words[starts[t]:starts[t] + read_words]``.
    Nothing is bounds-checked: the caller keeps every run inside ``words`` and gives
    ``starts`` and ``out`` that many entries."""
    lanes = vectors * LANES

    @intrinsic
    def fold(typingctx, words, starts, read_words, out):
        def codegen(context, builder, signature, args):
            words_ty, starts_ty, _, out_ty = signature.args
            data = context.make_array(words_ty)(context, builder, args[0]).data
            start = context.make_array(starts_ty)(context, builder, args[1]).data
            result = context.make_array(out_ty)(context, builder, args[3]).data
            count = args[2]
            slot = [builder.gep(data, [builder.load(builder.gep(start, [ir.Constant(_I64, t)]))])
                    for t in range(lanes)]
            accs = [cgutils.alloca_once_value(builder, _splat(0)) for _ in range(vectors)]
            chunks = builder.udiv(count, ir.Constant(_I64, LANES))
            with cgutils.for_range(builder, chunks) as loop:     # eight words at a time
                offset = builder.mul(loop.index, ir.Constant(_I64, LANES))
                for v in range(vectors):
                    rows = [builder.load(builder.bitcast(builder.gep(slot[v * LANES + t], [offset]),
                                                         _VECTOR.as_pointer()), align=8)
                            for t in range(LANES)]
                    acc = builder.load(accs[v])
                    for column in _transpose(builder, rows):
                        acc = _fold_vector(builder, acc, column)
                    builder.store(acc, accs[v])
            tail = builder.mul(chunks, ir.Constant(_I64, LANES))
            with cgutils.for_range_slice(builder, tail, count, ir.Constant(_I64, 1),
                                         inc=True) as (w, _):     # the last words, one by one
                for v in range(vectors):
                    column = ir.Constant(_VECTOR, ir.Undefined)
                    for t in range(LANES):
                        word = builder.load(builder.gep(slot[v * LANES + t], [w]))
                        column = builder.insert_element(column, word, ir.Constant(_I32, t))
                    builder.store(_fold_vector(builder, builder.load(accs[v]), column), accs[v])
            for v in range(vectors):
                target = builder.gep(result, [ir.Constant(_I64, v * LANES)])
                builder.store(builder.load(accs[v]), builder.bitcast(target, _VECTOR.as_pointer()),
                              align=8)
            return context.get_dummy_value()

        return numba.types.void(words, starts, read_words, out), codegen

    return fold


_fold_block = _fold_slots_intrinsic(BLOCK // LANES)
_fold_vector_of_slots = _fold_slots_intrinsic(1)


def fold_rows_py(words, row_words, page_size, token_words, read_words, slots, out):
    """``out[i]`` = the fold of the first ``read_words`` words of slot ``slots[i]``, where
    ``words`` is the source as one uint64 run (row ``r`` starts at word ``r * row_words``,
    slot ``s`` at ``(s // page_size) * row_words + (s % page_size) * token_words``). Every
    slot must lie inside the source: nothing is bounds-checked. ``BLOCK`` slots per pass,
    then ``LANES`` at a time (the last vector's spare lanes fold its last slot again)."""
    n = slots.shape[0]
    starts = np.empty(BLOCK, np.int64)
    folded = np.empty(BLOCK, np.uint64)
    base = 0
    while n - base >= BLOCK:
        for t in range(BLOCK):
            s = slots[base + t]
            starts[t] = (s // page_size) * row_words + (s % page_size) * token_words
        _fold_block(words, starts, read_words, folded)
        out[base:base + BLOCK] = folded
        base += BLOCK
    while base < n:
        m = min(LANES, n - base)
        for t in range(LANES):
            s = slots[base + min(t, m - 1)]
            starts[t] = (s // page_size) * row_words + (s % page_size) * token_words
        _fold_vector_of_slots(words, starts, read_words, folded)
        out[base:base + m] = folded[:m]
        base += m


fold_rows = compiled(fold_rows_py, nogil=True, boundscheck=False)
