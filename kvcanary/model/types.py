"""The data types of the public API: real-KV sources (:mod:`kvcanary.model.sources`), plans
(:mod:`kvcanary.model.plans`), the violation log and the launch context, all importable from here.
Field names, dtypes and shapes are upstream's (docs/format.md §6).

Construction brings arrays in (DLPack for foreign arrays) and checks what upstream checks
there (a real-KV source's layout); the other checks run at launch, where upstream runs them,
through the ``validate`` methods. Each rule is checked by one function."""

from __future__ import annotations

import numpy as np

from . import arrays as A
from . import overlap
from ..format.consts import (
    CANARY_FIELDS_PER_SLOT,
    MAX_REAL_KV_SOURCES,
    VIOLATION_FIELDS,
    VIOLATION_WRITE_INDEX_MAX,
    RealKvHashMode,
)
from ..format.errors import CanaryError, CanaryTypeError
from .plans import VerifyPlan, WritePlan
from .sources import RealKvSource, check_source_bound, check_source_count

__all__ = ["CanaryContext", "RealKvSource", "VerifyPlan", "ViolationLog", "WritePlan",
           "check_source_bound", "check_source_count", "to_host"]


class ViolationLog:
    """The shared violation sink: an ``int64[cap, 8]`` ring that never wraps and an
    ``int32[1]`` index that always counts, so ``write_index - cap`` rows were dropped.

    Launches append rows in place; read them with :meth:`rows` (a host copy) or
    :meth:`violations` (:class:`kvcanary.Violation` objects), count them with ``total``,
    ``dropped`` and ``ring_overflow``, and :meth:`clear` between steps. ``ViolationLog.allocate(
    1024)`` (``xp=cupy`` on the GPU); one log may be shared by several contexts.
    """

    def __init__(self, ring, write_index):
        self.ring = A.as_array(ring, "violation_ring")
        self.write_index = A.as_array(write_index, "violation_write_index")

    @classmethod
    def allocate(cls, ring_capacity: int, xp=np) -> "ViolationLog":
        if ring_capacity <= 0:
            raise CanaryError(
                f"ViolationLog ring_capacity must be positive, got {ring_capacity}",
                key="ring_capacity"
            )
        return cls(
            ring=xp.zeros((ring_capacity, VIOLATION_FIELDS), dtype=xp.int64),
            write_index=xp.zeros(1, dtype=xp.int32),
        )

    def validate(self) -> None:
        A.check_contiguous(self.ring, "violation_ring")
        A.check_dtype(self.ring, "violation_ring", np.int64)
        A.check_ndim(self.ring, "violation_ring", 2)
        if self.ring.shape[1] != VIOLATION_FIELDS or self.ring.shape[0] < 1:
            raise CanaryError(
                f"violation_ring must have shape [N, {VIOLATION_FIELDS}] with N >= 1, "
                f"got {tuple(self.ring.shape)}", key="violation_ring"
            )
        A.check_aligned(self.ring, "violation_ring")
        A.check_array(self.write_index, "violation_write_index", A.INT32, 1, 1)
        A.check_writeable(self.ring, "violation_ring")
        A.check_writeable(self.write_index, "violation_write_index")

    @property
    def ring_capacity(self) -> int:
        return int(self.ring.shape[0])

    @property
    def total(self) -> int:
        """Violations recorded since the last clear, dropped ones included.

        A negative index is corrupted state (the index only counts up from 0 and saturates,
        never wraps): reading it, and so every count, :attr:`is_errored` and the rows, raises
        :class:`CanaryError` naming ``violation_write_index``. Launches still append to such a
        log as the kernels do; :meth:`clear` makes it whole again."""
        total = int(to_host(self.write_index)[0])
        if total < 0:
            raise CanaryError(
                f"violation_write_index is {total}: the log is corrupted (the index counts up "
                f"from 0 and never wraps); clear() the log before reading it",
                key="violation_write_index")
        return total

    @property
    def valid_rows(self) -> int:
        return max(0, min(self.total, self.ring_capacity))

    @property
    def ring_overflow(self) -> bool:
        return self.total > self.ring_capacity

    @property
    def dropped(self) -> int:
        return max(0, self.total - self.ring_capacity)

    @property
    def is_errored(self) -> bool:
        return self.total > 0

    @property
    def saturated(self) -> bool:
        """The index reached ``2**31 - 1`` and stopped there (it never wraps to negative):
        the total is a lower bound, and later violations store no row."""
        return self.total == VIOLATION_WRITE_INDEX_MAX

    def clear(self) -> None:
        self.ring[...] = 0
        self.write_index[...] = 0

    def rows(self) -> np.ndarray:
        """The valid rows as a host ``int64[valid_rows, 8]`` copy, in ring order."""
        return np.array(to_host(self.ring[: self.valid_rows]), dtype=np.int64, copy=True)

    def violations(self) -> list:
        from ..format.violations import Violation

        return [Violation.from_row(row) for row in self.rows()]


def to_host(array) -> np.ndarray:
    """A numpy view of a numpy array, a host copy of a cupy one."""
    return array.get() if A.is_cupy_array(array) else np.asarray(array)


class CanaryContext:
    """Everything a write or verify launch needs besides its plan.

    ``canary_buf`` uint8 ``[num_slots, CANARY_SLOT_BYTES]`` holds one record per KV slot
    (slot 0 is padding); ``kernel_kind`` (a :class:`kvcanary.LaunchTag`) is stamped into
    every violation row; ``violation_log`` (:class:`ViolationLog`) receives the rows;
    ``slot_run_counter`` and ``kernel_run_counter`` int64 ``[1]`` count checked slots and
    launches; ``real_kv_sources`` (up to ``max_real_kv_sources`` :class:`RealKvSource`) are
    hashed per ``real_kv_hash_mode``; ``enable_chain_position_assert`` int32 ``[1]`` (default
    on) makes write check each chain's positions. ``extensions=False`` turns kvcanary's
    launch-time extension rows off (today the write's ``WRITE_SLOT_CONFLICT``), for upstream's
    bytes exactly, as ``audit --compat`` does for the audit; ``SLOT_OUT_OF_RANGE`` stays on
    either way, since the alternative is a read or write outside an array.
    ``chain_across_requests=True`` lets a write's seed be a record the same launch stores: a
    seed slot an earlier request of the launch writes links to that write, as if requests ran
    one after another (an engine whose requests chain across requests within one step, such
    as vLLM's same-step prefix hits); by default every seed is read before the launch stores
    anything (docs/extensions.md). All arrays of one library and device; the
    launches write ``canary_buf`` (write), the log and the counters in place.

    >>> import numpy as np, kvcanary as kc
    >>> ctx = kc.CanaryContext(np.zeros((1024, kc.CANARY_SLOT_BYTES), np.uint8),
    ...     kernel_kind=kc.LaunchTag.TAIL_K_FULL, violation_log=kc.ViolationLog.allocate(64),
    ...     slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64))
    >>> ctx.num_slots
    1024
    """

    def __init__(
        self,
        canary_buf,
        *,
        kernel_kind,
        violation_log: ViolationLog,
        slot_run_counter,
        kernel_run_counter,
        real_kv_sources=(),
        real_kv_hash_mode=RealKvHashMode.NONE,
        enable_chain_position_assert=None,
        max_real_kv_sources: int = MAX_REAL_KV_SOURCES,
        extensions: bool = True,
        chain_across_requests: bool = False,
    ):
        self.canary_buf = A.as_array(canary_buf, "canary_buf")
        self.kernel_kind = A.check_int64(kernel_kind, "kernel_kind")
        self.violation_log = violation_log
        self.slot_run_counter = A.as_array(slot_run_counter, "slot_run_counter")
        self.kernel_run_counter = A.as_array(kernel_run_counter, "kernel_run_counter")
        self.real_kv_sources = tuple(real_kv_sources)
        self.real_kv_hash_mode = RealKvHashMode(int(real_kv_hash_mode))
        if enable_chain_position_assert is None:
            xp = _namespace(self.canary_buf)
            enable_chain_position_assert = xp.ones(1, dtype=xp.int32)
        self.enable_chain_position_assert = A.as_array(
            enable_chain_position_assert, "enable_chain_position_assert"
        )
        self.max_real_kv_sources = check_source_bound(max_real_kv_sources)
        self.extensions = bool(extensions)
        self.chain_across_requests = bool(chain_across_requests)

    @property
    def num_slots(self) -> int:
        return int(self.canary_buf.shape[0])

    @property
    def hashing(self) -> bool:
        """Whether launches fold real KV bytes (a mode other than NONE and any source)."""
        return self.real_kv_hash_mode != RealKvHashMode.NONE and len(self.real_kv_sources) > 0

    def validate_sources(self) -> None:
        """The source-count bound and the sources' type: a launch checks them first, on every
        backend, before its other arguments (then :meth:`validate_arrays`)."""
        check_source_count(len(self.real_kv_sources), self.max_real_kv_sources)
        for index, source in enumerate(self.real_kv_sources):
            if not isinstance(source, RealKvSource):
                raise CanaryTypeError(
                    f"real_kv_sources[{index}] must be a RealKvSource, "
                    f"got {type(source).__name__}", key=f"real_kv_sources[{index}]"
                )

    def validate(self) -> None:
        """Every launch-time check of the context, in upstream's order: the sources, then
        the arrays. A launch runs the two halves apart (its plan is checked between them),
        each once."""
        self.validate_sources()
        self.validate_arrays()

    def validate_arrays(self) -> None:
        """The launch-time checks of the context's arrays (the sources passed
        :meth:`validate_sources`): dtypes, shapes, strides, one library, no shared memory."""
        state = self._launch_state()
        if state == self.__dict__.get("_passed"):
            return  # the same arrays and sources as the last launch, unchanged: they pass again
        buf = self.canary_buf
        A.check_contiguous(buf, "canary_buf")
        A.check_dtype(buf, "canary_buf", np.uint8)
        A.check_ndim(buf, "canary_buf", 2)
        if buf.shape[1] < CANARY_FIELDS_PER_SLOT * 8:
            raise CanaryError(
                "canary_buf slot stride must hold at least 4 int64 fields, "
                f"got {buf.shape[1] // 8}", key="canary_buf"
            )
        if buf.shape[1] % 8:
            raise CanaryError(
                f"canary_buf slot stride must be a multiple of 8 bytes, got {buf.shape[1]}",
                key="canary_buf"
            )
        A.check_aligned(buf, "canary_buf", 8)  # records are read as int64 fields
        self.violation_log.validate()
        A.check_array(self.slot_run_counter, "slot_run_counter", A.INT64, 1, 1)
        A.check_array(self.kernel_run_counter, "kernel_run_counter", A.INT64, 1, 1)
        for name in ("slot_run_counter", "kernel_run_counter"):
            A.check_writeable(getattr(self, name), name)
        A.check_array(
            self.enable_chain_position_assert, "enable_chain_position_assert", A.INT32, 1, 1
        )
        library = A.library_of(buf)
        for index, source in enumerate(self.real_kv_sources):
            name = f"real_kv_sources[{index}].tensor"
            if A.library_of(source.tensor) != library:
                raise CanaryError(
                    f"{name} is a {A.library_of(source.tensor)} array but canary_buf "
                    f"is a {library} array; pass arrays of one library", key=name
                )
            if self.hashing:  # NONE mode never dereferences a source
                # Again, not only when built: object.__setattr__ still reaches a slot.
                source.check_layout(source.page_size, source.num_bytes_per_token,
                                    source.read_bytes)
                source.check_row_width()
        arrays = A.context_arrays(self, sources=False)
        A.check_disjoint(arrays)
        written = overlap.extents({name: arrays[name] for name in WRITTEN})
        sources = overlap.extents({f"real_kv_sources[{index}].tensor": source.tensor
                                   for index, source in enumerate(self.real_kv_sources)})
        pair = overlap.first_overlap(written, sources, False)   # sources are only read
        if pair is not None:
            raise overlap.shared_memory_error(*pair, "a launch of this context")
        self._written = written
        self._passed = state
        self._library = A.common_library(*A.context_arrays(self).values())

    def written_extents(self) -> overlap.Extents:
        """The byte extents of the arrays the context's launches write (``WRITTEN``: the
        canary buffer, which write stores into, the ring and its index, the counters) when it
        last passed :meth:`validate` (:mod:`kvcanary.model.overlap`)."""
        return self._written

    def library(self) -> str | None:
        """The one library of the context's arrays (source tensors included) when it last
        passed :meth:`validate`, or None when they mix libraries."""
        return self._library

    def _launch_state(self) -> tuple:
        """Everything :meth:`validate_arrays` reads (a launch checks the source bound apart)."""
        log = self.violation_log
        return (
            A.array_state(self.canary_buf), type(log), A.array_state(getattr(log, "ring", None)),
            A.array_state(getattr(log, "write_index", None)),
            A.array_state(self.slot_run_counter), A.array_state(self.kernel_run_counter),
            A.array_state(self.enable_chain_position_assert), self.real_kv_hash_mode,
            tuple((type(source), source.page_size, source.num_bytes_per_token,
                   source.read_bytes, A.array_state(source.tensor))
                  for source in self.real_kv_sources),
        )


# The context's arrays a launch writes, by their names in errors: verify only reads the
# canary buffer, but write stores into it, so no other argument of either may share its bytes.
WRITTEN = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
           "kernel_run_counter")


def _namespace(array):
    if A.is_cupy_array(array):
        import cupy

        return cupy
    return np
