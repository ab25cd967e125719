"""The one checker behind :func:`load` and :func:`save`: ``{key: array}`` as a validated
:class:`Dump`, or a :class:`DumpError` naming the file and the key."""

from __future__ import annotations

import numpy as np

from ..format.consts import LaunchTag, RealKvHashMode
from .model import (DUMP_VERSION, KNOWN_KEYS, REAL_KV_PREFIX, REQUIRED_KEYS, VERSION_KEY, Dump,
                    INT64_KEYS, DumpError, widen)
from .read import MAX_NPZ_EXPANSION, MAX_NPZ_EXPANSION_FLOOR, read_raw


# Tokens per block of a paged dump: engines use up to a few hundred; a larger value would
# let a few bytes of block table claim millions of positions to audit.
MAX_BLOCK_SIZE = 1 << 16


class _Checker:
    def __init__(self, path: str, values: dict):
        self.path, self.values = path, values

    def fail(self, key: str, message: str):
        raise DumpError(f"{self.path}: key {key}: {message}", key=key)

    def get(self, key: str, *, required: bool, because: str | None = None):
        if key not in self.values:
            if required:
                why = (f"required with {because}, which is present: add it or drop {because}"
                       if because else "required by dump format v1")
                raise DumpError(f"{self.path}: key {key}: missing ({why})", key=key)
            return None
        value = self.values[key]
        if value.dtype.kind in "OV" and not key.startswith("real_kv_"):
            self.fail(key, f"unsupported dtype {value.dtype}")
        return value

    def integer(self, key: str, array, dtypes, ndim: int, shape: tuple | None = None):
        wanted = " or ".join(np.dtype(d).name for d in dtypes)
        if array.dtype not in [np.dtype(d) for d in dtypes]:
            self.fail(key, f"dtype must be {wanted}, got {array.dtype}")
        if array.ndim != ndim:
            self.fail(key, f"must be {ndim}-D, got shape {tuple(array.shape)}")
        if shape is not None:
            for axis, (got, want) in enumerate(zip(array.shape, shape)):
                if want is not None and got != want:
                    self.fail(key, f"shape {tuple(array.shape)} does not match: dim {axis} must "
                                   f"be {want}")
        return _aligned(array)

    def scalar_int(self, key: str, array) -> int:
        if array.dtype.kind not in "iu" or array.size != 1 or array.ndim > 1:
            self.fail(key, f"must be an integer scalar, got dtype {array.dtype} shape "
                           f"{tuple(array.shape)}")
        return int(np.asarray(array).reshape(-1)[0])

    def string(self, key: str, array) -> str:
        if array.dtype.kind not in "US" or array.ndim != 0:
            self.fail(key, f"must be a string (0-d unicode array), got dtype {array.dtype} "
                           f"shape {tuple(array.shape)}")
        if not _valid_unicode(array):
            self.fail(key, "holds an invalid string (code points outside unicode)")
        value = array[()]
        try:
            return value.decode() if isinstance(value, bytes) else str(value)
        except UnicodeError:
            self.fail(key, "holds an invalid string (not UTF-8)")

    def nonnegative(self, key: str, array):
        if array.size and int(np.min(array)) < 0:
            self.fail(key, f"holds a negative value ({int(np.min(array))})")


def _aligned(array, alignment: int | None = None):
    """``array``, or an aligned copy when its data starts off its element alignment (a
    ``.npy`` header whose length is not a multiple of the alignment, memory-mapped): the
    launches refuse misaligned arrays."""
    alignment = alignment or array.dtype.itemsize
    if array.size and array.__array_interface__["data"][0] % alignment:
        return np.array(array, copy=True)
    return array


def _valid_unicode(array) -> bool:
    """Whether a ``U`` array holds only unicode code points: numpy turns a corrupt one into a
    Python string with a deferred SystemError instead of raising."""
    if array.dtype.kind != "U":
        return True
    order = ">" if array.dtype.byteorder == ">" else "<"
    codes = np.frombuffer(np.ascontiguousarray(array).tobytes(), dtype=f"{order}u4")
    return bool(((codes <= 0x10FFFF) & ((codes < 0xD800) | (codes > 0xDFFF))).all())


def load(path) -> Dump:
    """Read and validate the dump at ``path`` (an ``.npz`` or ``.safetensors`` file, or a
    directory of ``KEY.npy`` files) and return a :class:`Dump` of numpy arrays
    (memory-mapped where the container allows). Never writes to the input.

    Refuses, with a :class:`DumpError` whose message names the file and the key: a path
    that holds no dump ("not a kvcanary dump", listing the missing required keys), a missing
    required key, a dtype, shape or value outside ``docs/dump-format.md`` (narrower integers
    of an int64 key are widened losslessly, as :func:`save` does), inconsistent optional
    groups, pickled objects, and containers whose sizes do not add up (truncated files,
    forged sizes, zip bombs)."""
    path = str(path)
    flavour, values = read_raw(path)
    return validate(path, flavour, values)


def validate(path: str, flavour: str, values: dict) -> Dump:
    """The one checker behind :func:`load` and :func:`save`: ``values`` (key -> numpy
    array, as read from a container) as a :class:`Dump`, or :class:`DumpError`."""
    if VERSION_KEY not in values:
        missing = ", ".join(key for key in REQUIRED_KEYS if key not in values)
        raise DumpError(f"{path}: not a kvcanary dump: it lacks the required key(s) {missing} "
                        f"(write dumps with kvcanary.dump.save, which adds {VERSION_KEY}; a "
                        f"hand-made dump needs {VERSION_KEY} = {DUMP_VERSION} too: "
                        "docs/dump-format.md lists every key)")
    present = {key: value.present_rows for key, value in values.items()
               if getattr(value, "present_rows", None) is not None}   # sparse files' data
    for key, ranges in present.items():
        _check_sparse_widening(path, key, values[key], ranges)
    values = widen(values)
    c = _Checker(path, values)
    version = c.scalar_int(VERSION_KEY, c.get(VERSION_KEY, required=True))
    if version != DUMP_VERSION:
        c.fail(VERSION_KEY, f"unsupported dump version {version} (this kvcanary reads {DUMP_VERSION})")

    canary = c.get("canary", required=True)
    if canary.dtype == np.int64:
        c.integer("canary", canary, (np.int64,), 2, (None, 4))
        canary = canary.view(np.uint8) if canary.flags.c_contiguous else None
        if canary is None:
            c.fail("canary", "int64 canary must be C-contiguous")
    else:
        c.integer("canary", canary, (np.uint8,), 2)
        if canary.shape[1] < 32 or canary.shape[1] % 8:
            c.fail("canary", f"slot stride must be a multiple of 8 bytes and at least 32, got "
                             f"shape {tuple(canary.shape)}")
    if canary.shape[0] < 1:
        c.fail("canary", "has no slots")
    if not canary.flags.c_contiguous:
        canary = np.ascontiguousarray(canary)
    canary = _aligned(canary, 8)  # records are read as int64 fields

    req_to_token, block_table, block_size = _load_slot_table(c)
    rows = c.integer("req_pool_indices", c.get("req_pool_indices", required=True), (np.int64,), 1)
    bs = rows.shape[0]
    seq_lens = c.integer("seq_lens", c.get("seq_lens", required=True), (np.int64,), 1, (bs,))
    dump = Dump(path=path, flavour=flavour, canary=canary, req_to_token=req_to_token,
                req_pool_indices=rows, seq_lens=seq_lens, block_table=block_table,
                block_size=block_size, present_rows=present)
    _nonnegative(c, dump, "req_pool_indices")
    _nonnegative(c, dump, "seq_lens")
    # A row outside the table is a wrong dump, not a corrupt record: one error, not a finding
    # at every position of the row.
    table, table_key = (req_to_token, "req_to_token") if block_table is None else (
        block_table, "block_table")
    outside = _first(dump, "req_pool_indices", lambda part: part >= table.shape[0])
    if outside is None and bs and not table.shape[0]:
        outside = 0   # even a padding row, which a sparse file's holes hold, is outside
    if outside is not None:
        index = outside
        c.fail("req_pool_indices", f"req_pool_indices[{index}] = {int(rows[index])} is outside "
                                   f"{table_key}, which has {table.shape[0]} rows")
    # Positions past the table are findings (out of the table), but a length far past it is
    # a corrupt value that would make the audit enumerate up to 2**63 entries.
    width = dump.table_positions
    live = dump.live_batch()
    over = np.flatnonzero(np.asarray(seq_lens[live]) > 2 * width) if live.size else live
    if over.size:
        index = int(live[over[0]])
        covered = (f"req_to_token's width {width}" if block_table is None else
                   f"the {width} positions block_table covers ({block_table.shape[1]} blocks of "
                   f"{block_size})")
        c.fail("seq_lens", f"seq_lens[{index}] = {int(seq_lens[index])} is more than twice "
                           f"{covered}: a corrupt length (positions past the "
                           "table are reported as findings up to twice its width)")

    tag = c.get("launch_tag", required=False)
    if tag is not None:
        name = c.string("launch_tag", tag).strip().upper()
        if name not in LaunchTag.__members__:
            shown = name if len(name) <= 40 else name[:40] + "..."
            c.fail("launch_tag", f"unknown launch tag {shown!r} (one of "
                                 f"{', '.join(LaunchTag.__members__)})")
        dump.launch_tag = LaunchTag[name]

    _load_real_kv(c, dump)
    _load_swa(c, dump)
    _load_expected(c, dump, bs)
    _load_sweep(c, dump)

    dump.extra = _Extras()
    for key, value in values.items():
        if key in KNOWN_KEYS or key.startswith(REAL_KV_PREFIX):
            continue
        dict.__setitem__(dump.extra, key, value if hasattr(value, "load") else _extra(value))
    return dump


def _check_sparse_widening(path: str, key: str, array, ranges) -> None:
    """Widening a narrow integer array of a sparse file to int64 allocates 8 bytes for every
    row its header declares, held or not: bounded like an archive's expansion (its holes are
    never read, but the widened array is memory)."""
    if key not in INT64_KEYS or array.dtype == np.int64 or array.dtype.kind not in "iu":
        return
    row_bytes = array.nbytes // max(1, array.shape[0])
    held = sum(end - begin for begin, end in ranges) * row_bytes
    widened = array.size * 8
    limit = max(MAX_NPZ_EXPANSION_FLOOR, MAX_NPZ_EXPANSION * held)
    if widened > limit:
        raise DumpError(f"{path}: key {key}: a sparse {array.dtype} file declaring "
                        f"{array.shape[0]} rows, {held} bytes of them held: widened to int64 "
                        f"it would take {widened} bytes, above the limit of {limit}; save "
                        "it as int64 (whose holes cost nothing)")


def _first(dump: Dump, key: str, test) -> int | None:
    """The first row of ``key`` where ``test`` (of a slice of the array) holds, scanned a
    slice at a time over the rows that hold data (:meth:`Dump.row_ranges`)."""
    array = getattr(dump, key)
    for begin, end in dump.row_ranges(key):
        hits = np.flatnonzero(test(np.asarray(array[begin:end])))
        if hits.size:
            return begin + int(hits[0])
    return None


def _nonnegative(c: _Checker, dump: Dump, key: str) -> None:
    """``c.nonnegative`` for a batch array, a slice at a time over the rows holding data."""
    array = getattr(dump, key)
    least = min((int(np.min(array[begin:end])) for begin, end in dump.row_ranges(key)
                 if end > begin), default=0)
    if least < 0:
        c.fail(key, f"holds a negative value ({least})")


def _extra(value):
    """An extra as the dump holds it: a unicode scalar as ``str`` (invalid unicode stays an
    array: the audit ignores extras)."""
    if value.dtype.kind == "U" and value.ndim == 0 and _valid_unicode(value):
        return str(value[()])
    return value


class _Extras(dict):
    """``Dump.extra``: an ``.npz`` member is read on first access, never by the audit."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if hasattr(value, "load"):
            value = _extra(value.load())
            super().__setitem__(key, value)
        return value

    def get(self, key, default=None):
        return self[key] if key in self else default

    def values(self):
        return [self[key] for key in self]

    def items(self):
        return [(key, self[key]) for key in self]


def _load_slot_table(c: _Checker) -> tuple:
    """``(req_to_token, block_table, block_size)``: a dump holds exactly one of the tables."""
    if "block_table" not in c.values:
        if "block_size" in c.values:
            c.fail("block_size", "goes with block_table, but the dump holds req_to_token")
        if "req_to_token" not in c.values:
            c.fail("req_to_token", "missing: a dump needs req_to_token, or block_table with "
                                   "block_size (required by dump format v1)")
        table = c.integer("req_to_token", c.get("req_to_token", required=True),
                          (np.int32, np.int64), 2)
        return table, None, 1
    if "req_to_token" in c.values:
        c.fail("block_table", "a dump holds one of req_to_token or block_table, not both")
    table = c.integer("block_table", c.get("block_table", required=True), (np.int32, np.int64), 2)
    block_size = c.scalar_int("block_size", c.get("block_size", required=True))
    if block_size < 1:
        c.fail("block_size", f"must be >= 1, got {block_size}")
    if block_size > MAX_BLOCK_SIZE:
        c.fail("block_size", f"must be at most {MAX_BLOCK_SIZE} tokens per block, got {block_size}")
    return None, table, block_size


def _load_real_kv(c: _Checker, dump: Dump) -> None:
    from ..model.types import RealKvSource

    source_keys = sorted(k for k in c.values if k.startswith("real_kv_")
                         and k[len("real_kv_"):].isdigit())
    params = c.get("real_kv_params", required=bool(source_keys))
    if params is None:
        mode = c.get("real_kv_hash_mode", required=False)
        if mode is not None:
            dump.real_kv_hash_mode = _mode(c, mode)
        return
    count = params.shape[0] if params.ndim == 2 else -1
    c.integer("real_kv_params", params, (np.int64,), 2, (None, 3))
    expected = [f"real_kv_{i}" for i in range(count)]
    for key in expected:
        c.get(key, required=True)
    extra = sorted(set(source_keys) - set(expected))
    if extra:
        c.fail(extra[0], f"real_kv_params has {count} rows, so sources are real_kv_0 .. "
                         f"real_kv_{count - 1}")
    dump.real_kv_hash_mode = _mode(c, c.get("real_kv_hash_mode", required=True))
    dump.real_kv_params = np.asarray(params)
    sources = []
    for index, key in enumerate(expected):
        tensor = c.values[key]
        if tensor.dtype.kind == "O":
            c.fail(key, "object arrays are refused")
        layout = dict(zip(("page_size", "num_bytes_per_token", "read_bytes"),
                          (int(v) for v in params[index])))
        try:
            RealKvSource.check_layout(**layout)
        except ValueError as exc:
            c.fail(f"real_kv_params[{index}]", getattr(exc, "detail", str(exc)))
        try:  # (a Fortran-order file is read in C order: rows must be runs of bytes)
            source = RealKvSource(np.ascontiguousarray(tensor), **layout)
            if dump.real_kv_hash_mode != RealKvHashMode.NONE:
                source.check_row_width()
        except ValueError as exc:
            c.fail(key, getattr(exc, "detail", str(exc)))
        sources.append(source.tensor)
    dump.real_kv = tuple(sources)


def _mode(c: _Checker, array) -> RealKvHashMode:
    try:
        return RealKvHashMode.from_name(c.string("real_kv_hash_mode", array))
    except ValueError as exc:
        detail = str(exc)
    c.fail("real_kv_hash_mode", detail)


def _load_swa(c: _Checker, dump: Dump) -> None:
    window = c.get("swa_window_size", required=False)
    if window is not None:
        dump.swa_window_size = c.scalar_int("swa_window_size", window)
        if dump.swa_window_size < 0:
            c.fail("swa_window_size", f"must be >= 0, got {dump.swa_window_size}")
    lut = c.get("full_to_swa_index_mapping", required=dump.swa_window_size > 0)
    if lut is not None:
        dump.full_to_swa_index_mapping = c.integer("full_to_swa_index_mapping", lut, (np.int64,), 1)


def _load_expected(c: _Checker, dump: Dump, bs: int) -> None:
    pool = c.get("expected_tokens", required=False)
    lens = c.get("expected_tokens_valid_lens", required=pool is not None,
                 because="expected_tokens")
    if lens is not None and pool is None:
        c.get("expected_tokens", required=True, because="expected_tokens_valid_lens")
    if pool is None:
        return
    dump.expected_tokens = c.integer("expected_tokens", pool, (np.int32, np.int64), 2,
                                     (dump.slot_table.shape[0], None))
    dump.expected_tokens_valid_lens = c.integer("expected_tokens_valid_lens", lens, (np.int64,),
                                                1, (bs,))
    _nonnegative(c, dump, "expected_tokens_valid_lens")


def _load_sweep(c: _Checker, dump: Dump) -> None:
    keys = ("sweep_slot_indices", "sweep_prev_slot_indices", "sweep_positions")
    present = [k for k in keys if k in c.values]
    if not present:
        return
    arrays = [c.get(k, required=True) for k in keys]
    length = arrays[0].shape[0] if arrays[0].ndim == 1 else None
    arrays = [c.integer(key, array, (np.int64,), 1, (length,))
              for key, array in zip(keys, arrays)]
    dump.sweep_slot_indices, dump.sweep_prev_slot_indices, dump.sweep_positions = arrays
    _nonnegative(c, dump, "sweep_positions")
