"""The plans a launch reads: :class:`VerifyPlan` (the prefix slots to verify) and
:class:`WritePlan` (the requests to write), as :func:`kvcanary.plan` fills them."""

from __future__ import annotations

import numpy as np

from . import arrays as A
from . import overlap
from ..format.consts import EXPECTED_TOKEN_UNKNOWN
from ..format.errors import CanaryError


class VerifyPlan:
    """Which prefix slots one verify launch checks, and against what (upstream's fields).

    ``verify_slot_indices``, ``verify_expected_tokens`` (-1: unknown), ``verify_expected_positions``
    and ``verify_prev_slot_indices`` (-1: chain head) are int64 ``[verify_capacity]``;
    ``verify_num_valid`` and ``enable`` are int32 ``[1]``. :func:`kvcanary.plan` fills them in
    place; :func:`kvcanary.verify` reads the first ``verify_num_valid`` entries. Allocate once
    (numpy, or ``xp=cupy`` on the GPU) and reuse every step: ``VerifyPlan.allocate(4096)``.
    """

    FIELDS = (
        "verify_slot_indices",
        "verify_expected_tokens",
        "verify_expected_positions",
        "verify_prev_slot_indices",
    )

    def __init__(self, verify_slot_indices, verify_expected_tokens, verify_expected_positions,
                 verify_prev_slot_indices, verify_num_valid, enable):
        self.verify_slot_indices = A.as_array(verify_slot_indices, "plan.verify_slot_indices")
        self.verify_expected_tokens = A.as_array(verify_expected_tokens,
                                                 "plan.verify_expected_tokens")
        self.verify_expected_positions = A.as_array(verify_expected_positions,
                                                    "plan.verify_expected_positions")
        self.verify_prev_slot_indices = A.as_array(verify_prev_slot_indices,
                                                   "plan.verify_prev_slot_indices")
        self.verify_num_valid = A.as_array(verify_num_valid, "plan.verify_num_valid")
        self.enable = A.as_array(enable, "plan.enable")

    @classmethod
    def allocate(cls, verify_capacity: int, xp=np) -> "VerifyPlan":
        """A plan of ``verify_capacity`` entries (``xp``: numpy or cupy).

        Sizing rule: one entry per prefix token verified in a step, i.e. at least
        ``sum(prefix_len - window_start)`` over the batch's live rows (``window_start`` is
        ``max(0, prefix_len - swa_window_size)`` with a sliding window, else 0);
        :func:`kvcanary.entries_needed` computes it. With less, ``plan`` disables the launch
        (``enable = 0``, upstream's rule) and warns :class:`kvcanary.VerifyPlanTooSmall`.

        >>> VerifyPlan.allocate(8).verify_capacity
        8
        """
        if verify_capacity <= 0:
            raise CanaryError(
                f"VerifyPlan verify_capacity must be positive, got {verify_capacity}",
                key="verify_capacity"
            )
        return cls(
            verify_slot_indices=xp.zeros(verify_capacity, dtype=xp.int64),
            verify_expected_tokens=xp.full(verify_capacity, EXPECTED_TOKEN_UNKNOWN, dtype=xp.int64),
            verify_expected_positions=xp.zeros(verify_capacity, dtype=xp.int64),
            verify_prev_slot_indices=xp.zeros(verify_capacity, dtype=xp.int64),
            verify_num_valid=xp.zeros(1, dtype=xp.int32),
            enable=xp.ones(1, dtype=xp.int32),
        )

    @property
    def verify_capacity(self) -> int:
        return int(self.verify_slot_indices.shape[0])

    ARRAYS = FIELDS + ("verify_num_valid", "enable")

    def arrays(self) -> dict:
        return {f"plan.{n}": getattr(self, n) for n in self.ARRAYS}

    def validate(self) -> None:
        state = [A.array_state(getattr(self, n)) for n in self.ARRAYS]
        if state == self.__dict__.get("_passed"):
            return  # the same arrays as the last launch, unchanged: they pass again
        capacity = self.verify_slot_indices.shape[0] if self.verify_slot_indices.ndim else 0
        for name in self.FIELDS:
            A.check_array(getattr(self, name), f"plan.{name}", A.INT64, 1, capacity)
        A.check_array(self.verify_num_valid, "plan.verify_num_valid", A.INT32, 1, 1)
        A.check_array(self.enable, "plan.enable", A.INT32, 1, 1)
        A.check_disjoint(self.arrays())
        self._extents = overlap.extents(self.arrays())
        self._passed = state
        self._library = A.common_library(*(getattr(self, n) for n in self.ARRAYS))
        self._writeable = A.all_writeable(getattr(self, n) for n in self.ARRAYS)

    def extents(self) -> overlap.Extents:
        """The byte extents of the plan's arrays when it last passed :meth:`validate`
        (:mod:`kvcanary.model.overlap`): a new object whenever an array changed."""
        return self._extents

    def library(self) -> str | None:
        """The one library of the plan's arrays when it last passed :meth:`validate`, or
        None when they mix libraries."""
        return self._library

    def writeable(self) -> bool:
        """Whether every array of the plan was writeable when it last passed
        :meth:`validate` (a launch that writes the plan refuses a read-only one)."""
        return self._writeable


class WritePlan:
    """Which requests one write launch stamps: CSR offsets into the step's tokens and each
    request's seed slot (upstream's fields).

    ``write_offsets`` int64 ``[write_req_capacity + 1]`` (request ``r`` writes tokens
    ``offsets[r]:offsets[r + 1]``), ``write_seed_slot_indices`` int64 ``[write_req_capacity]``
    (the slot of the token before each request's first new one, -1: none) and
    ``write_num_valid_reqs`` int32 ``[1]``. :func:`kvcanary.plan` fills them in place; the plan
    also owns the kernels' scratch, so no launch allocates (CUDA-graph safe). Allocate once:
    ``WritePlan.allocate(256)`` (``xp=cupy`` on the GPU).
    """

    # Kernel working memory, allocated with the plan so that no launch allocates (a launch
    # captured in a CUDA graph must not free memory the pool hands out again): the plan
    # kernels' per-row verify offsets, and each request's seed link and position, read by
    # the write before anything of the launch is stored. Not part of the plan's contents.
    SCRATCH = ("plan_offsets_scratch", "seed_links_scratch", "seed_positions_scratch")

    def __init__(self, write_offsets, write_seed_slot_indices, write_num_valid_reqs):
        self.write_offsets = A.as_array(write_offsets, "plan.write_offsets")
        self.write_seed_slot_indices = A.as_array(write_seed_slot_indices,
                                                  "plan.write_seed_slot_indices")
        self.write_num_valid_reqs = A.as_array(write_num_valid_reqs, "plan.write_num_valid_reqs")
        self._allocate_scratch()

    def _allocate_scratch(self) -> None:
        seeds = self.write_seed_slot_indices
        if seeds is None or seeds.ndim != 1:
            return  # validate() names the problem
        capacity = int(seeds.shape[0])
        for name, length in zip(self.SCRATCH, (capacity + 1, capacity, capacity)):
            setattr(self, name, _zeros_like(seeds, length))

    def _scratch_fits(self) -> bool:
        seeds = self.write_seed_slot_indices
        scratch = getattr(self, self.SCRATCH[-1], None)
        return (scratch is not None and scratch.shape[0] == seeds.shape[0]
                and type(scratch) is type(seeds) and _device_of(scratch) == _device_of(seeds))

    @classmethod
    def allocate(cls, write_req_capacity: int, xp=np) -> "WritePlan":
        if write_req_capacity <= 0:
            raise CanaryError(
                "WritePlan write_req_capacity must be positive, "
                f"got {write_req_capacity}", key="write_req_capacity"
            )
        return cls(
            write_offsets=xp.zeros(write_req_capacity + 1, dtype=xp.int64),
            write_seed_slot_indices=xp.full(write_req_capacity, -1, dtype=xp.int64),
            write_num_valid_reqs=xp.zeros(1, dtype=xp.int32),
        )

    @property
    def write_req_capacity(self) -> int:
        return int(self.write_seed_slot_indices.shape[0])

    ARRAYS = ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")

    def arrays(self) -> dict:
        return {
            "plan.write_offsets": self.write_offsets,
            "plan.write_seed_slot_indices": self.write_seed_slot_indices,
            "plan.write_num_valid_reqs": self.write_num_valid_reqs,
        }

    def validate(self) -> None:
        state = [A.array_state(getattr(self, n, None)) for n in self.ARRAYS + self.SCRATCH]
        if state == self.__dict__.get("_passed"):
            return  # the same arrays as the last launch, unchanged: they pass again
        A.check_array(self.write_seed_slot_indices, "plan.write_seed_slot_indices", A.INT64, 1)
        A.check_array(self.write_offsets, "plan.write_offsets", A.INT64, 1)
        A.check_array(self.write_num_valid_reqs, "plan.write_num_valid_reqs", A.INT32, 1, 1)
        capacity = self.write_req_capacity
        if self.write_offsets.shape[0] != capacity + 1:
            raise CanaryError(
                "write_offsets_len must equal write_req_capacity + 1, got "
                f"{self.write_offsets.shape[0]} and {capacity + 1}", key="write_offsets"
            )
        if not self._scratch_fits():  # the arrays were replaced after construction
            self._allocate_scratch()
        A.check_disjoint(self.arrays())
        self._extents = overlap.extents(self.arrays())   # the scratch is its own allocation
        self._passed = [A.array_state(getattr(self, n)) for n in self.ARRAYS + self.SCRATCH]
        self._library = A.common_library(*(getattr(self, n) for n in self.ARRAYS))
        self._writeable = A.all_writeable(getattr(self, n) for n in self.ARRAYS)

    library = VerifyPlan.library
    extents = VerifyPlan.extents
    writeable = VerifyPlan.writeable


def _zeros_like(array, length: int):
    """int64 zeros of the array's library, on the array's device."""
    if A.is_cupy_array(array):
        import cupy

        with array.device:
            return cupy.zeros(length, dtype=cupy.int64)
    return np.zeros(length, dtype=np.int64)


def _device_of(array):
    return array.data.device_id if A.is_cupy_array(array) else None
