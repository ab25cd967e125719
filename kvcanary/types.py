"""The data types of the public API: real-KV sources, plans, the violation log and the
launch context. Field names, dtypes and shapes are upstream's (docs/format.md §6).

Construction brings arrays in (DLPack for foreign arrays) and checks what upstream checks
there (a real-KV source's layout); the other checks run at launch, where upstream runs them,
through the ``validate`` methods. Each rule is checked by one function."""

from __future__ import annotations

import numpy as np

from . import arrays as A
from .consts import (
    CANARY_FIELDS_PER_SLOT,
    EXPECTED_TOKEN_UNKNOWN,
    MAX_REAL_KV_SOURCES,
    MAX_REAL_KV_SOURCES_LIMIT,
    REAL_KV_ALIGN_BYTES,
    REAL_KV_PARTIAL_READ_BYTES,
    VIOLATION_FIELDS,
    VIOLATION_WRITE_INDEX_MAX,
    RealKvHashMode,
)
from .errors import ERROR_PREFIX, CanaryError

_INT64 = (np.int64,)
_INT32 = (np.int32,)


def check_source_bound(max_real_kv_sources) -> int:
    """The source-count bound a context (and its kernel variant) is built for: 1..64."""
    bound = int(max_real_kv_sources)
    if not 1 <= bound <= MAX_REAL_KV_SOURCES_LIMIT:
        raise CanaryError(
            f"max_real_kv_sources must be in [1, {MAX_REAL_KV_SOURCES_LIMIT}], "
            f"got {max_real_kv_sources}", key="max_real_kv_sources"
        )
    return bound


def check_source_count(count: int, bound: int,
                       raise_with: str = "CanaryContext(max_real_kv_sources=N)") -> None:
    """At most ``bound`` real-KV sources: the kernels take that many descriptors by value.
    ``raise_with`` says where the caller sets the bound."""
    if count > bound and count > MAX_REAL_KV_SOURCES_LIMIT:   # no bound would help
        raise CanaryError(
            f"at most {bound} RealKvSource entries supported by the CUDA ABI, "
            f"got {count}\n(no kernel variant takes more than {MAX_REAL_KV_SOURCES_LIMIT} "
            "sources: fingerprint fewer of the KV pool's pieces)", key="real_kv_sources"
        )
    if count > bound:
        raise CanaryError(
            f"at most {bound} RealKvSource entries supported by the CUDA ABI, "
            f"got {count}\n"
            f"(the bound applies to every backend, numpy included; pass {raise_with} with "
            f"N >= {count}, at most {MAX_REAL_KV_SOURCES_LIMIT}, to compile a kernel variant "
            "with more sources; no rebuild is needed)", key="real_kv_sources"
        )


class RealKvSource:
    """One piece of the real KV pool to fingerprint.

    ``tensor`` is any 2-D array of any element type (numpy, cupy, or anything that speaks
    DLPack: torch, jax, ... in bf16, fp8, fp4, ...) whose last dimension is unit-stride. It is
    kept as its bytes, ``uint8 [rows, row_bytes]``, sharing the producer's memory (no copy;
    the producer's buffer stays alive while the source does); the row stride is the array's
    own, so rows may be wider than the slots they pack. Slot ``s`` reads
    ``(s // page_size) * row_stride + (s % page_size) * num_bytes_per_token`` onwards.

    A source is immutable once built (setting a field raises ``AttributeError``): its layout
    is checked against the tensor once, here.

    A copy (``copy.deepcopy``, pickle) is a source over a copy of the producer's tensor, so an
    object graph copied whole keeps the producer's tensor and its source one buffer.
    """

    def __init__(self, tensor, *, page_size: int, num_bytes_per_token: int, read_bytes: int):
        self.check_layout(page_size, num_bytes_per_token, read_bytes)
        self.tensor = _byte_rows(tensor, "RealKvSource.tensor")
        self._producer_tensor = tensor
        self.page_size = int(page_size)
        self.num_bytes_per_token = int(num_bytes_per_token)
        self.read_bytes = int(read_bytes)
        self._frozen = True

    def __setattr__(self, name, value):
        # Immutable once built: the layout was checked against the tensor here, and a launch
        # reads exactly the bytes that layout names (a larger read_bytes set later made the
        # kernels read past the tensor while the reference clamped).
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"{ERROR_PREFIX}RealKvSource is immutable (cannot set {name}); "
                                 "build a new source for another layout")
        super().__setattr__(name, value)

    def __delattr__(self, name):
        raise AttributeError(f"{ERROR_PREFIX}RealKvSource is immutable (cannot delete {name})")

    def __reduce__(self):
        # Copying the byte view alone would give it memory of its own (numpy copies a view as
        # a new array), so bytes written later through the producer's copy would not be the
        # bytes hashed: rebuild the view over the producer's copy instead.
        return (_source_over, (self._producer_tensor, self.page_size, self.num_bytes_per_token,
                               self.read_bytes))

    @staticmethod
    def check_layout(page_size: int, num_bytes_per_token: int, read_bytes: int) -> None:
        """The slot layout inside a row, in upstream's order of checks."""
        if page_size < 1:
            raise CanaryError(f"RealKvSource.page_size must be >= 1, got {page_size}",
                              key="page_size")
        if num_bytes_per_token <= 0 or num_bytes_per_token % REAL_KV_ALIGN_BYTES:
            raise CanaryError(
                "RealKvSource.num_bytes_per_token must be a positive multiple of 16, "
                f"got {num_bytes_per_token}", key="num_bytes_per_token"
            )
        if read_bytes <= 0 or read_bytes > num_bytes_per_token or read_bytes % REAL_KV_ALIGN_BYTES:
            raise CanaryError(
                "RealKvSource.read_bytes must be a positive multiple of 16 in "
                f"(0, num_bytes_per_token={num_bytes_per_token}], got {read_bytes}",
                key="read_bytes"
            )

    @property
    def row_stride_bytes(self) -> int:
        return int(self.tensor.strides[0])

    @property
    def row_bytes(self) -> int:
        """Readable bytes per row."""
        return int(self.tensor.shape[1])

    @property
    def num_slots(self) -> int:
        """How many slots this source holds bytes for."""
        return int(self.tensor.shape[0]) * self.page_size

    def effective_read_bytes(self, mode: RealKvHashMode) -> int:
        if mode == RealKvHashMode.NONE:
            return 0
        if mode == RealKvHashMode.PARTIAL:
            return REAL_KV_PARTIAL_READ_BYTES
        return self.read_bytes

    def check_row_width(self) -> None:
        """Each row holds its ``page_size`` slots (checked when hashing). A source may hold
        fewer slots than the canary buffer: a slot past its rows is reported, never read."""
        min_row_bytes = self.page_size * self.num_bytes_per_token
        if self.row_bytes < min_row_bytes:
            raise CanaryError(
                "RealKvSource row is too narrow for its slot layout: dim-1 is "
                f"{self.row_bytes} bytes but page_size={self.page_size} x "
                f"num_bytes_per_token={self.num_bytes_per_token} needs {min_row_bytes}"
            )


def _source_over(tensor, page_size: int, num_bytes_per_token: int,
                 read_bytes: int) -> RealKvSource:
    return RealKvSource(tensor, page_size=page_size, num_bytes_per_token=num_bytes_per_token,
                        read_bytes=read_bytes)


def _byte_rows(tensor, name: str):
    """A source tensor as ``uint8 [rows, row_bytes]`` over the same memory: 2-D, its last
    dimension unit-stride, its row stride a multiple of 16 bytes (the kernels' loads)."""
    view = A.byte_view(tensor, name)
    if len(view.shape) < 2:
        raise CanaryError(f"{name} must be at least 2-D, got shape {view.shape}", key=name)
    if len(view.shape) != 2:
        raise CanaryError(
            f"{name} (viewed as uint8) must be 2-D, got {len(view.shape)}-D", key=name)
    if view.strides[0] % REAL_KV_ALIGN_BYTES:
        raise CanaryError(
            f"{name} row stride must be a multiple of 16 bytes, got "
            f"{view.strides[0]} bytes (shape={view.shape}, strides={view.strides}, "
            f"dtype={view.dtype})", key=name
        )
    if view.array is None:
        raise CanaryError(
            f"{name} last dimension must be unit-stride, got "
            f"strides={view.strides} for dtype={view.dtype}", key=name
        )
    return view.array


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
            A.check_array(getattr(self, name), f"plan.{name}", _INT64, 1, capacity)
        A.check_array(self.verify_num_valid, "plan.verify_num_valid", _INT32, 1, 1)
        A.check_array(self.enable, "plan.enable", _INT32, 1, 1)
        A.check_disjoint(self.arrays())
        self._passed = state
        self._library = A.common_library(*(getattr(self, n) for n in self.ARRAYS))

    def library(self) -> str | None:
        """The one library of the plan's arrays when it last passed :meth:`validate`, or
        None when they mix libraries."""
        return self._library


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
        A.check_array(self.write_seed_slot_indices, "plan.write_seed_slot_indices", _INT64, 1)
        A.check_array(self.write_offsets, "plan.write_offsets", _INT64, 1)
        A.check_array(self.write_num_valid_reqs, "plan.write_num_valid_reqs", _INT32, 1, 1)
        capacity = self.write_req_capacity
        if self.write_offsets.shape[0] != capacity + 1:
            raise CanaryError(
                "write_offsets_len must equal write_req_capacity + 1, got "
                f"{self.write_offsets.shape[0]} and {capacity + 1}", key="write_offsets"
            )
        if not self._scratch_fits():  # the arrays were replaced after construction
            self._allocate_scratch()
        A.check_disjoint(self.arrays())
        self._passed = [A.array_state(getattr(self, n)) for n in self.ARRAYS + self.SCRATCH]
        self._library = A.common_library(*(getattr(self, n) for n in self.ARRAYS))

    library = VerifyPlan.library


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
        A.check_array(self.write_index, "violation_write_index", _INT32, 1, 1)
        A.check_writeable(self.ring, "violation_ring")
        A.check_writeable(self.write_index, "violation_write_index")

    @property
    def ring_capacity(self) -> int:
        return int(self.ring.shape[0])

    @property
    def total(self) -> int:
        """Violations recorded since the last clear, dropped ones included."""
        return int(to_host(self.write_index)[0])

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
        from .violations import Violation

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
    either way, since the alternative is a read or write outside an array
    (docs/extensions.md). All arrays of one library and device; the
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

    @property
    def num_slots(self) -> int:
        return int(self.canary_buf.shape[0])

    @property
    def hashing(self) -> bool:
        """Whether launches fold real KV bytes (a mode other than NONE and any source)."""
        return self.real_kv_hash_mode != RealKvHashMode.NONE and len(self.real_kv_sources) > 0

    def validate_sources(self) -> None:
        """The source-count bound: checked first, on every backend, before any launch."""
        check_source_count(len(self.real_kv_sources), self.max_real_kv_sources)
        for index, source in enumerate(self.real_kv_sources):
            if not isinstance(source, RealKvSource):
                raise CanaryTypeError(
                    f"real_kv_sources[{index}] must be a RealKvSource, "
                    f"got {type(source).__name__}", key=f"real_kv_sources[{index}]"
                )

    def validate(self) -> None:
        """Every launch-time check of the context, in upstream's order."""
        self.validate_sources()
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
        A.check_array(self.slot_run_counter, "slot_run_counter", _INT64, 1, 1)
        A.check_array(self.kernel_run_counter, "kernel_run_counter", _INT64, 1, 1)
        for name in ("slot_run_counter", "kernel_run_counter"):
            A.check_writeable(getattr(self, name), name)
        A.check_array(
            self.enable_chain_position_assert, "enable_chain_position_assert", _INT32, 1, 1
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
                source.check_row_width()
        log = self.violation_log
        A.check_disjoint({"canary_buf": buf, "violation_ring": log.ring,
                          "violation_write_index": log.write_index,
                          "slot_run_counter": self.slot_run_counter,
                          "kernel_run_counter": self.kernel_run_counter,
                          "enable_chain_position_assert": self.enable_chain_position_assert})
        self._passed = state
        self._library = A.common_library(
            buf, log.ring, log.write_index, self.slot_run_counter, self.kernel_run_counter,
            self.enable_chain_position_assert, *(source.tensor for source in self.real_kv_sources))

    def library(self) -> str | None:
        """The one library of the context's arrays (source tensors included) when it last
        passed :meth:`validate`, or None when they mix libraries."""
        return self._library

    def _launch_state(self) -> tuple:
        """Everything :meth:`validate` reads beyond the source bound (which it always checks)."""
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


def _zeros_like(array, length: int):
    """int64 zeros of the array's library, on the array's device."""
    if A.is_cupy_array(array):
        import cupy

        with array.device:
            return cupy.zeros(length, dtype=cupy.int64)
    return np.zeros(length, dtype=np.int64)


def _device_of(array):
    return array.data.device_id if A.is_cupy_array(array) else None


def _namespace(array):
    if A.is_cupy_array(array):
        import cupy

        return cupy
    return np
