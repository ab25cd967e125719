"""Memory shared across a launch's arguments: an array a launch writes may share no byte with
any other array of the launch (a verify plan's slots over the ring, ``input_ids`` over the
canary buffer, a source over the canary), since what the others read would then depend on
the order the backend stores in, and the numpy reference and the CUDA kernels store in
different orders.

Arrays are compared by their byte extents: the first and past-the-last byte their elements
can reach (:func:`kvcanary.model.arrays.byte_span`), for host and device arrays alike, so
both backends refuse the same arguments. Each object a launch takes (a context, a plan) keeps
the extents of its arrays from the check that passed (:func:`extents`); the pairs of objects
a launch combines are compared once per pair of extents (:func:`check_pair`), so a repeated
launch with the same objects compares only its fresh arrays (:func:`check_fresh`), one
bisection each."""

from __future__ import annotations

from bisect import bisect_right

from . import arrays as A
from ..format.errors import CanaryError


class Extents(tuple):
    """``(begin, end, name)`` byte extents of named arrays, sorted by ``begin``; empty arrays
    (nothing to read or write) are left out. Its ``pairs`` remember the extents it was
    compared with (:func:`check_pair`); an owner makes new extents whenever an array changes,
    so a remembered pair is one of unchanged arrays."""

    def __new__(cls, items=()):
        self = super().__new__(cls, items)
        self.pairs = {}
        return self


def extents(arrays: dict) -> Extents:
    """The extents of ``arrays`` (name -> array or None)."""
    return Extents(sorted((*A.byte_span(array), name) for name, array in arrays.items()
                          if array is not None and array.size))


def shared_memory_error(written: str, other: str, launch: str) -> CanaryError:
    return CanaryError(f"{written} and {other} share memory; pass separate arrays ({launch} "
                       f"writes {written} in place, so what it reads of {other} would depend "
                       "on the order of its stores)", key=written)


def first_overlap(written: Extents, others: Extents, others_written: bool):
    """``(written name, other name)`` of the first pair that shares a byte, where the pair
    holds at least one written array and the arrays of ``written`` are apart; else None.
    One sweep in address order: an extent overlaps an earlier one exactly when it begins
    before the largest end seen so far."""
    items = sorted([(b, e, n, True) for b, e, n in written]
                   + [(b, e, n, others_written) for b, e, n in others])
    written_end, written_name, any_end, any_name = -1, None, -1, None
    for begin, end, name, is_written in items:
        if begin < written_end:
            return written_name, name
        if is_written and begin < any_end:
            return name, any_name
        if is_written and end > written_end:
            written_end, written_name = end, name
        if end > any_end:
            any_end, any_name = end, name
    return None


class WrittenSet:
    """A launch's written extents, pairwise apart and sorted, with their ends for bisection."""

    __slots__ = ("items", "begins", "ends")

    def __init__(self, items):
        self.items = tuple(sorted(items))
        self.begins = [b for b, _, _ in self.items]
        self.ends = [e for _, e, _ in self.items]


def check_pair(written: Extents, other: Extents, other_written: bool,
               launch: str) -> WrittenSet:
    """Refuse a byte shared by an array of ``written`` and one of ``other`` (written too when
    ``other_written``), naming both; return the launch's written extents (both objects' when
    ``other_written``). Remembered per pair of extents objects: a launch repeated with the
    same objects compares nothing here."""
    hit = written.pairs.get(id(other))
    if hit is not None and hit[0] is other and hit[1] is other_written:
        return hit[2]
    pair = first_overlap(written, other, other_written)
    if pair is not None:
        raise shared_memory_error(*pair, launch)
    result = WrittenSet(tuple(written) + (tuple(other) if other_written else ()))
    if len(written.pairs) >= _PAIRS_KEPT:
        written.pairs.clear()
    written.pairs[id(other)] = (other, other_written, result)   # ``other`` kept: its id stays
    return result


_PAIRS_KEPT = 16


def check_fresh(written: WrittenSet, arrays: dict, launch: str, library: str,
                addresses: dict | None = None) -> None:
    """Refuse a byte shared by one of ``arrays`` (contiguous arrays of ``library`` the launch
    only reads, already checked one by one) and a written array, one bisection each.
    Read-only arrays may share memory with each other. ``addresses`` holds the data
    addresses the checks one by one read (:func:`kvcanary.model.arrays.check_array`), by the
    names of ``arrays``; an array it lacks is read here."""
    ends, begins, items = written.ends, written.begins, written.items
    device = library == "cupy"
    known = addresses or {}
    for name, array in arrays.items():
        if array is None:
            continue
        size = array.nbytes
        if not size:
            continue
        begin = known.get(name)
        if begin is None:
            begin = array.data.ptr if device else A.data_address(array)
        index = bisect_right(ends, begin)   # the first written extent ending past ``begin``
        if index < len(ends) and begins[index] < begin + size:
            raise shared_memory_error(items[index][2], name, launch)
