"""Run a launch on the other array library: copy the arguments over, copy back what the
launch changed. Used when ``backend=`` names a library other than the arrays' own."""

from __future__ import annotations

import contextlib
import copy

import numpy as np

from ..model import arrays as A
from ..model.types import CanaryContext, RealKvSource, VerifyPlan, ViolationLog, WritePlan


def _to_library(array, library: str):
    if array is None:
        return None
    if library == "cupy":
        import cupy

        return cupy.asarray(array)
    return array.get() if A.is_cupy_array(array) else np.asarray(array)


class _Mover:
    def __init__(self, library: str):
        self.library = library
        self.pairs = []  # (original, moved) arrays

    def array(self, original):
        if original is None:
            return None
        moved = _to_library(original, self.library)
        if self.library == "cupy":
            moved = moved.copy() if moved is original else moved
        else:
            moved = np.array(moved, copy=True)
        self.pairs.append((original, moved))
        return moved

    def value(self, value):
        if isinstance(value, (VerifyPlan, WritePlan, ViolationLog)):
            moved = copy.copy(value)
            for name, array in vars(value).items():
                if hasattr(array, "shape"):
                    object.__setattr__(moved, name, self.array(array))
            return moved
        if isinstance(value, RealKvSource):
            moved = copy.copy(value)
            object.__setattr__(moved, "tensor", self.array(value.tensor))
            return moved
        if isinstance(value, CanaryContext):
            moved = copy.copy(value)
            for name in ("canary_buf", "slot_run_counter", "kernel_run_counter",
                         "enable_chain_position_assert"):
                setattr(moved, name, self.array(getattr(value, name)))
            moved.violation_log = self.value(value.violation_log)
            moved.real_kv_sources = tuple(self.value(s) for s in value.real_kv_sources)
            return moved
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            return self.array(value)
        return value

    def copy_back(self) -> None:
        for original, moved in self.pairs:
            back = _to_library(moved, A.library_of(original))
            if not (back.shape == original.shape and (back == original).all()):
                original[...] = back


@contextlib.contextmanager
def moved(kwargs: dict, library: str):
    mover = _Mover(library)
    yield {name: mover.value(value) for name, value in kwargs.items()}
    mover.copy_back()
