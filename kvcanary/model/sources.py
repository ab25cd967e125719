"""Real-KV sources: the KV bytes a canary hashes (:class:`RealKvSource`, checked at
construction as upstream checks it), and the bound on how many a launch takes."""

from __future__ import annotations

from . import arrays as A
from ..format.consts import (
    MAX_REAL_KV_SOURCES_LIMIT,
    REAL_KV_ALIGN_BYTES,
    REAL_KV_PARTIAL_READ_BYTES,
    RealKvHashMode,
)
from ..format.errors import ERROR_PREFIX, CanaryError


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
