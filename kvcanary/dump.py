"""Dump format v1: one canary buffer and the tables needed to verify it.

Three containers hold the same keys (docs/dump-format.md):

* ``.npz``            a numpy zip archive (``numpy.savez``),
* a directory         one ``KEY.npy`` file per key, memory-mapped on load,
* ``.safetensors``    through the ``safetensors`` package's numpy API (optional import);
                      strings live in the file's metadata, KV of dtypes numpy lacks (bf16,
                      fp8) is read as raw bytes.

``save(path, **arrays)`` takes numpy or cupy arrays, anything with ``__dlpack__`` or
``__array__`` (torch tensors work without kvcanary importing torch), Python ints and strings.
``load(path)`` validates every key and returns a :class:`Dump`; any problem raises
:class:`DumpError`, whose message names the file and the key. Loading never writes to the input.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import stat
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from .arrays import as_array
from .atomic import replacing
from .consts import LaunchTag, RealKvHashMode
from .errors import ToolError

DUMP_VERSION = 1
VERSION_KEY = "kvcanary_dump_version"
STRING_KEYS = ("launch_tag", "real_kv_hash_mode")
SYNTH_PREFIX = "synth_"
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_]+")

# safetensors dtype names numpy can represent; others are read as raw bytes.
_SAFETENSORS_NUMPY = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "F16": np.float16, "U32": np.uint32, "I32": np.int32, "F32": np.float32,
    "U64": np.uint64, "I64": np.int64, "F64": np.float64,
}


class DumpError(ToolError):
    """A dump that cannot be read or does not follow format v1. The message names the file
    and the key at fault."""


@dataclass(eq=False)
class Dump:
    """A validated dump. Arrays are numpy (memory-mapped and read-only where the container
    allows); ``canary`` is always the ``uint8 [num_slots, stride]`` view."""

    path: str
    flavour: str
    canary: np.ndarray
    req_to_token: np.ndarray | None   # None in a paged dump, which holds block_table instead
    req_pool_indices: np.ndarray
    seq_lens: np.ndarray
    launch_tag: LaunchTag = LaunchTag.TAIL_K_FULL
    block_table: np.ndarray | None = None
    block_size: int = 1
    real_kv: tuple = ()
    real_kv_params: np.ndarray | None = None
    real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE
    swa_window_size: int = 0
    full_to_swa_index_mapping: np.ndarray | None = None
    expected_tokens: np.ndarray | None = None
    expected_tokens_valid_lens: np.ndarray | None = None
    sweep_slot_indices: np.ndarray | None = None
    sweep_prev_slot_indices: np.ndarray | None = None
    sweep_positions: np.ndarray | None = None
    extra: dict = field(default_factory=dict)

    @property
    def num_slots(self) -> int:
        return int(self.canary.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def slot_table(self) -> np.ndarray:
        """The table the dump holds: ``req_to_token``, or ``block_table`` in a paged dump."""
        return self.req_to_token if self.block_table is None else self.block_table

    @property
    def table_positions(self) -> int:
        """Positions a row of the slot table covers (0 for a table without rows: its width
        is a claim no entry backs)."""
        if self.slot_table.shape[0] == 0:
            return 0
        return int(self.slot_table.shape[1]) * self.block_size

    def plan_table(self, convert=lambda array: array) -> dict:
        """The slot-table keywords of ``kvcanary.plan`` (arrays through ``convert``)."""
        if self.block_table is None:
            return {"req_to_token": convert(self.req_to_token)}
        return {"block_table": convert(self.block_table), "block_size": self.block_size}

    @property
    def num_sweep_entries(self) -> int:
        return 0 if self.sweep_slot_indices is None else int(self.sweep_slot_indices.shape[0])

    def string(self, key: str, default: str | None = None) -> str | None:
        """An extra (e.g. ``synth_``) string value."""
        value = self.extra.get(key)
        return default if value is None else str(value)


# --------------------------------------------------------------------------- save


def flavour_of(path) -> str:
    """``npz``, ``safetensors`` or ``dir`` (anything else: a directory of ``.npy``)."""
    name = str(path)
    if name.endswith(".npz"):
        return "npz"
    if name.endswith(".safetensors"):
        return "safetensors"
    return "dir"


def _host_array(value, key: str) -> np.ndarray:
    """Any supported value as a numpy array (a copy only where the source is not host memory)."""
    if isinstance(value, str):
        return np.array(value)
    if isinstance(value, (bool, int, np.integer)):
        return np.array(int(value), dtype=np.int64)
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        return np.asarray(value)
    if type(value).__module__.split(".")[0] == "cupy":
        return value.get()
    if hasattr(value, "__dlpack__") and hasattr(value, "__dlpack_device__"):
        try:  # zero-copy; KV of a type numpy lacks (bf16, fp8) is kept as its bytes
            array = as_array(value, key, untyped_as_bytes=True)
        except ValueError as exc:
            raise DumpError(f"key {key}: {getattr(exc, 'detail', exc)}", key=key) from None
        return array if isinstance(array, np.ndarray) else array.get()
    if hasattr(value, "__array__"):
        try:
            return np.asarray(value)
        except Exception as exc:
            raise DumpError(f"key {key}: cannot convert {type(value).__name__} to numpy ({exc}); "
                            "for dtypes numpy lacks (bf16, fp8) pass a uint8 view") from None
    raise DumpError(f"key {key}: unsupported value of type {type(value).__name__}")


def save(path, **arrays) -> str:
    """Write a dump to ``path`` and return the path.

    The container follows the path: ``.npz``, ``.safetensors`` (needs the ``safetensors``
    package), anything else a directory of ``KEY.npy`` files (created; an earlier dump there
    is replaced as a whole). Keys and their dtypes and shapes are described in
    ``docs/dump-format.md``; ``kvcanary_dump_version`` is added when missing.

    Takes numpy or cupy arrays, anything with ``__dlpack__`` or ``__array__`` (torch tensors
    work; device memory is copied to the host), Python ints, lists and strings; ``None``
    values are skipped. Narrower integers of an int64 key (e.g. ``int32`` ``seq_lens``) are
    widened losslessly, as :func:`load` does.

    Refuses, with a :class:`DumpError` naming the key, before anything is written: a key
    the format does not define (with the nearest one it does; keys of the caller's own start
    with ``user_``), every dump :func:`load` would refuse (the same checker runs on the
    arrays), object arrays, values it cannot bring to the host, non-scalar strings in
    ``.safetensors``, and a directory that holds anything but an earlier dump. The dump is written under a temporary
    name and renamed when complete, so an error or an interrupt leaves no part of it."""
    path = str(path)
    flavour = flavour_of(path)
    for key in arrays:
        if not _PLAIN_KEY.fullmatch(key):
            raise DumpError(f"{path}: key {_shown(key)!r}: a key is a plain name (letters, "
                            "digits, _): it names a file inside a directory dump")
    check_key_names(path, arrays)
    values = {VERSION_KEY: np.array(DUMP_VERSION, dtype=np.int64)}
    for key, value in arrays.items():
        if value is None:
            continue
        array = _host_array(value, key)
        if array.dtype.kind == "O":
            raise DumpError(f"{path}: key {key}: object arrays cannot be dumped")
        values[key] = array
    values = widen(values)
    validate(path, flavour, values)
    if flavour == "safetensors":
        _require_safetensors(path)
    # Written under a temporary name and renamed when complete: an interrupt or an error
    # leaves the earlier dump at ``path`` (or nothing), never a part of the new one.
    try:
        _write(path, flavour, values)
    except DumpError:
        raise
    except Exception as exc:   # a full disk, a file-size limit, an unwritable folder
        if not isinstance(exc, OSError) and type(exc).__name__ != "SafetensorError":
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else _reason(exc)
        raise DumpError(f"{path}: cannot write the dump ({reason})") from None
    return path


def _write(path: str, flavour: str, values: dict) -> None:
    if flavour == "npz":
        with replacing(path) as temporary, open(temporary, "wb") as handle:
            np.savez(handle, **values)
    elif flavour == "dir":
        _check_replaceable_directory(path)
        with replacing(path, directory=True) as temporary:
            for key, array in values.items():
                np.save(os.path.join(temporary, f"{key}.npy"), array, allow_pickle=False)
    else:
        import safetensors.numpy

        metadata, tensors = {}, {}
        for key, array in values.items():
            if array.dtype.kind == "U":
                if array.ndim != 0:
                    raise DumpError(f"{path}: key {key}: safetensors holds strings only as 0-d values")
                metadata[key] = str(array[()])
            else:
                tensors[key] = np.ascontiguousarray(array)
        with replacing(path) as temporary:
            safetensors.numpy.save_file(tensors, temporary, metadata=metadata or None)


def _check_replaceable_directory(path: str) -> None:
    """A directory dump replaces only nothing, an empty directory or an earlier dump (as a
    whole); a directory holding anything else (another file, a folder, a link) is refused,
    so no other file is lost."""
    shown, path = path, path.rstrip("/" + os.sep) or path   # "x.npz/" names the file x.npz
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise DumpError(f"{shown}: exists and is not a directory; a dump path without .npz or "
                        ".safetensors is written as a directory of .npy files")
    names = sorted(os.listdir(path))
    if not names:
        return
    foreign = [name for name in names if not name.endswith(".npy")
               or not stat.S_ISREG(os.lstat(os.path.join(path, name)).st_mode)]
    if foreign or f"{VERSION_KEY}.npy" not in names:
        raise DumpError(f"{path}: the directory holds files that are not a kvcanary dump "
                        f"({(foreign or names)[0]}); write the dump to an empty or new directory")


CONTAINER_SUFFIXES = {".npz": "npz", ".safetensors": "safetensors", "": "dir"}


def container_for(path) -> str:
    """The container a new dump at ``path`` gets, strictly from its name: ``npz`` for
    ``.npz``, ``safetensors`` for ``.safetensors``, ``dir`` for a name without a suffix or
    ending in ``/``. Raises :class:`DumpError` for any other suffix, or when the container
    needs a package that is missing (``safetensors``)."""
    name = str(path)
    suffix = "" if name.endswith(("/", os.sep)) else os.path.splitext(name)[1]
    if suffix not in CONTAINER_SUFFIXES:
        raise DumpError(f"{name}: unknown dump container suffix {suffix!r}: use .npz, "
                        ".safetensors, or a name without a suffix (or ending in /) for a "
                        "directory of .npy files")
    flavour = CONTAINER_SUFFIXES[suffix]
    if flavour == "safetensors":
        _require_safetensors(name)
    return flavour


def _require_safetensors(path: str) -> None:
    try:
        import safetensors.numpy  # noqa: F401
    except ImportError:
        raise DumpError(f"{path}: .safetensors dumps need the safetensors package "
                        "(pip install safetensors)") from None


# --------------------------------------------------------------------------- load


# Bounds on what a container may make the loader allocate, checked before any allocation:
# a deflated member cannot expand more than deflate's ~1032:1; all members together may
# expand to at most MAX_NPZ_EXPANSION times the file (or MAX_NPZ_EXPANSION_FLOOR bytes,
# whichever is larger); a safetensors JSON header is at most 1 MiB (a dump's keys and
# strings take a few kilobytes; parsing the format's own limit of 100 MB costs gigabytes).
MAX_NPZ_EXPANSION = 256
MAX_NPZ_EXPANSION_FLOOR = 256 << 20
_DEFLATE_MAX_RATIO = 1032
MAX_SAFETENSORS_HEADER = 1 << 20
# Tokens per block of a paged dump: engines use up to a few hundred; a larger value would
# let a few bytes of block table claim millions of positions to audit.
MAX_BLOCK_SIZE = 1 << 16
_NPY_MAGIC = b"\x93NUMPY"


def _npy_layout(fp) -> tuple:
    """``(shape, dtype, header_bytes, data_bytes)`` of the ``.npy`` stream at ``fp``, read
    from its header alone (nothing is allocated for the data)."""
    from numpy.lib import format as npy_format

    start = fp.tell()
    version = npy_format.read_magic(fp)
    if version == (1, 0):
        shape, _, dtype = npy_format.read_array_header_1_0(fp)
    elif version == (2, 0):
        shape, _, dtype = npy_format.read_array_header_2_0(fp)
    else:   # 3.0 exists only for utf-8 field names: structured dtypes, refused anyway
        raise ValueError(f".npy format version {version[0]}.{version[1]} is not supported "
                         "(kvcanary reads 1.0 and 2.0)")
    if dtype.hasobject:
        raise ValueError("object (pickled) arrays are refused")
    count = 1
    for dim in shape:
        count *= int(dim)
    return tuple(shape), dtype, fp.tell() - start, count * dtype.itemsize


def _shown(name: str) -> str:
    """A key or file name as it may appear in a one-line message: a corrupt archive can name
    a member with control characters (a newline would split the message)."""
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")


def _describe(shape, dtype, nbytes) -> str:
    return f"shape {shape} of {dtype} ({nbytes} bytes)"


def _read_npz(path: str) -> dict:
    import zipfile

    from numpy.lib import format as npy_format

    try:
        with open(path, "rb") as handle:
            magic = handle.read(len(_NPY_MAGIC))
    except OSError as exc:
        raise DumpError(f"{path}: cannot read ({exc.strerror})") from None
    if magic == _NPY_MAGIC:
        raise DumpError(f"{path}: not an .npz archive (a single array)")
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, NotImplementedError) as exc:
        raise DumpError(f"{path}: not a readable .npz file ({_reason(exc)})") from None
    values = {}
    with archive:
        infos = archive.infolist()
        _check_zip_members(path, infos)
        for info in infos:
            name = info.filename.removesuffix(".npy")
            key = _shown(name)
            if not _read_key(name):
                continue
            try:
                with archive.open(info) as member:
                    shape, dtype, header, nbytes = _npy_layout(member)
                if header + nbytes != info.file_size:
                    raise DumpError(
                        f"{path}: key {key}: the .npy header declares "
                        f"{_describe(shape, dtype, nbytes)} but the archive member holds "
                        f"{max(0, info.file_size - header)} bytes of data")
                with archive.open(info) as member:
                    values[name] = npy_format.read_array(member, allow_pickle=False)
            except DumpError:
                raise
            except Exception as exc:
                raise DumpError(f"{path}: key {key}: cannot read ({_reason(exc)})") from None
    return values


def _check_zip_members(path: str, infos: list) -> None:
    """Refuse what would make reading the archive allocate or inflate more than the file can
    honestly hold: sizes a member's compression cannot produce, members past the end of the
    file or sharing their data (zip bombs), or too large a total expansion."""
    import zipfile

    size = os.path.getsize(path)
    spans, total = [], 0
    for info in infos:
        key = _shown(info.filename.removesuffix(".npy"))
        where = f"{path}: key {key}:"
        if info.flag_bits & 0x1:
            raise DumpError(f"{where} the archive member is encrypted")
        if info.compress_type == zipfile.ZIP_STORED:
            if info.compress_size != info.file_size:
                raise DumpError(f"{where} the stored archive member declares {info.file_size} "
                                f"bytes but occupies {info.compress_size}")
        elif info.compress_type == zipfile.ZIP_DEFLATED:
            if info.file_size > _DEFLATE_MAX_RATIO * info.compress_size + 1024:
                raise DumpError(f"{where} the archive member declares {info.file_size} bytes "
                                f"from {info.compress_size} compressed bytes, more than deflate "
                                "can produce (a corrupt or forged size)")
        else:
            raise DumpError(f"{where} the archive member uses zip compression method "
                            f"{info.compress_type}; .npz members are stored or deflated")
        begin = info.header_offset
        end = begin + 30 + len(info.filename.encode()) + info.compress_size
        if end > size:
            raise DumpError(f"{where} the archive member extends past the end of the file "
                            f"({end} > {size} bytes): the file is truncated or corrupt")
        spans.append((begin, end, key))
        total += info.file_size
    spans.sort()
    for (_, end, _), (begin, _, key) in zip(spans, spans[1:]):
        if begin < end:
            raise DumpError(f"{path}: key {key}: archive members overlap (a zip bomb or a "
                            "corrupt central directory)")
    limit = max(MAX_NPZ_EXPANSION_FLOOR, MAX_NPZ_EXPANSION * size)
    if total > limit:
        raise DumpError(f"{path}: the archive members expand to {total} bytes from a file of "
                        f"{size} bytes, above the limit of {limit} (a likely zip bomb); "
                        "save large dumps uncompressed (numpy.savez or kvcanary.dump.save)")


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    text = text[0] if text else type(exc).__name__
    if "allow_pickle" in text or "Object arrays" in text:
        return "object (pickled) arrays are refused"
    if "malformed node or string" in text or "Cannot parse header" in text:
        return "the .npy header cannot be parsed (not a literal Python dict)"
    if "magic string is not correct" in text:   # (numpy's text echoes the file's bytes)
        return "not a .npy file: it does not start with the .npy magic number"
    return text


def _refuse_a_folder_of_dumps(path: str) -> None:
    """A directory of dump files (and no ``.npy``) is a folder of dumps, not one dump: say
    so, and how to pass them."""
    try:
        names = os.listdir(path)
    except OSError:
        return   # _read_dir says why
    if any(name.endswith(".npy") for name in names):
        return
    suffixes = sorted({f".{flavour_of(name)}" for name in names if flavour_of(name) != "dir"})
    if suffixes:
        count = sum(flavour_of(name) != "dir" for name in names)
        raise DumpError(
            f"{path}: a folder of {count} dump file(s) ({', '.join(suffixes)}), not one dump "
            "(a dump directory holds one KEY.npy per key); pass the dumps themselves, e.g. "
            f"kvcanary audit {os.path.join(path, '*' + suffixes[0])}")


# Reads of a directory dump that a concurrent save replaced midway, retried from the start.
_DIR_READ_ATTEMPTS = 100


def _read_dir(path: str) -> dict:
    """Every ``.npy`` of one version of the directory: the files are opened through one
    handle on the directory, and a read during which ``save`` swapped in a new version
    (the old one may lose files as it is removed) starts again on the new one."""
    for attempt in range(_DIR_READ_ATTEMPTS):
        if attempt:   # back off a little, so a busy writer cannot starve the reader
            time.sleep(min(0.001 * attempt, 0.05))
        try:
            handle = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise DumpError(f"{path}: cannot list the dump directory ({exc.strerror})") from None
        try:
            held = os.fstat(handle)
            through = f"/proc/self/fd/{handle}"
            try:
                values = _read_dir_files(path, through if os.path.isdir(through) else path)
            except DumpError:
                if _still_published(path, held):
                    raise
                continue
            if _still_published(path, held):
                return values
        finally:
            os.close(handle)
    raise DumpError(f"{path}: the directory was replaced during every read; try again "
                    "when it is no longer being written")


def _still_published(path: str, held: os.stat_result) -> bool:
    try:
        now = os.stat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _read_dir_files(path: str, through: str) -> dict:
    values = {}
    try:
        names = sorted(os.listdir(through))
    except OSError as exc:
        raise DumpError(f"{path}: cannot list the dump directory ({exc.strerror})") from None
    for name in names:
        if not name.endswith(".npy"):
            continue
        raw_key, file = name[: -len(".npy")], os.path.join(through, name)
        key, shown = _shown(raw_key), os.path.join(path, _shown(name))
        try:
            _require_inside(path, through, name, shown, key)
            _require_regular(file, shown, key)
            if not _read_key(raw_key):
                continue
            with open(file, "rb") as handle:
                shape, dtype, header, nbytes = _npy_layout(handle)
            held = os.path.getsize(file) - header
            if nbytes > held:
                raise DumpError(f"{shown}: key {key}: the .npy header declares "
                                f"{_describe(shape, dtype, nbytes)} but the file holds "
                                f"{max(0, held)} bytes of data (truncated or corrupt)")
            try:
                values[raw_key] = np.load(file, mmap_mode="r", allow_pickle=False)
            except ValueError as exc:
                if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
                    raise
                values[raw_key] = np.load(file, allow_pickle=False)  # e.g. empty arrays
        except DumpError:
            raise
        except Exception as exc:
            raise DumpError(f"{shown}: key {key}: cannot read ({_reason(exc)})") from None
    return values


def _read_safetensors(path: str) -> dict:
    _require_safetensors(path)
    from safetensors import safe_open

    try:
        header = _safetensors_header(path)
        values = {}
        with safe_open(path, framework="numpy") as handle:
            for key, value in (handle.metadata() or {}).items():
                if key != "__metadata__":
                    values[key] = np.array(value)
            for key in handle.keys():
                if not _read_key(key):
                    continue
                info = header[key]
                if info["dtype"] in _SAFETENSORS_NUMPY:
                    values[key] = handle.get_tensor(key)
                else:
                    values[key] = _raw_tensor(path, header, key)
    except DumpError:
        raise
    except Exception as exc:
        raise DumpError(f"{path}: not a readable .safetensors file ({_reason(exc)})") from None
    return values


def _safetensors_header(path: str) -> tuple:
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise DumpError(f"{path}: truncated .safetensors header")
        (length,) = struct.unpack("<Q", head)
        available = os.fstat(handle.fileno()).st_size - 8
        if MAX_SAFETENSORS_HEADER < length <= available:
            raise DumpError(f"{path}: the .safetensors header declares {length} bytes of JSON, "
                            f"above the limit of {MAX_SAFETENSORS_HEADER} for a dump (its keys "
                            "and strings take a few kilobytes)")
        if length > available:
            raise DumpError(f"{path}: the .safetensors header declares {length} bytes of JSON "
                            f"but the file holds {max(0, available)} after the length field: "
                            "truncated or corrupt")
        header = json.loads(handle.read(length))
        if not isinstance(header, dict):
            raise DumpError(f"{path}: the .safetensors header is not a JSON object")
    header["__data_start__"] = 8 + length
    return header


def _raw_tensor(path: str, header: dict, key: str) -> np.ndarray:
    """A tensor of a dtype numpy lacks, as ``uint8`` with the last dim in bytes."""
    info = header[key]
    begin, end = info["data_offsets"]
    shape = list(info["shape"]) or [1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    nbytes = end - begin
    if rows <= 0 or nbytes % rows:
        raise DumpError(f"{path}: key {key}: {info['dtype']} data of {nbytes} bytes does not "
                        f"split into shape {info['shape']}")
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=header["__data_start__"] + begin,
                     shape=(nbytes,)) if nbytes else np.zeros(0, np.uint8)
    return data.reshape(shape[:-1] + [nbytes // rows])


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a special file"


def _require_regular(path: str, shown: str, key: str | None = None) -> None:
    """Refuse anything but a regular file before opening it: reading a FIFO or a device
    would block forever or never end."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        where = f"{shown}: key {key}" if key is not None else shown
        raise DumpError(f"{where}: is {_file_kind(mode)}, not a regular file; a dump holds "
                        "regular files only")


def _require_inside(path: str, through: str, name: str, shown: str, key: str) -> None:
    """A link in a directory dump may name another file of the dump, nothing outside it."""
    link = os.path.join(through, name)
    if not os.path.islink(link):
        return
    target = os.path.realpath(link)
    folder = os.path.realpath(through)
    if os.path.dirname(target) != folder:
        raise DumpError(f"{shown}: key {key}: is a link leaving the dump directory; a "
                        "directory dump's files live in it")


def read_raw(path) -> tuple[str, dict]:
    """``(flavour, {key: array})`` without validation."""
    path = str(path)
    try:
        os.stat(path)
    except OSError as exc:   # a missing file, a symbolic-link loop, an unsearchable folder
        raise DumpError(f"{_shown(path)}: {(exc.strerror or 'cannot read').lower()}") from None
    if os.path.isdir(path):
        _refuse_a_folder_of_dumps(path)
        return "dir", _read_dir(path)
    _require_regular(path, _shown(path))
    flavour = flavour_of(path)
    if flavour == "safetensors":
        return flavour, _read_safetensors(path)
    if flavour == "npz":
        return flavour, _read_npz(path)
    raise DumpError(f"{path}: unknown dump container (expected .npz, .safetensors or a "
                    "directory of .npy files)")


class _Checker:
    def __init__(self, path: str, values: dict):
        self.path, self.values = path, values

    def fail(self, key: str, message: str):
        raise DumpError(f"{self.path}: key {key}: {message}", key=key)

    def get(self, key: str, *, required: bool):
        if key not in self.values:
            if required:
                raise DumpError(f"{self.path}: key {key}: missing (required by dump format v1)")
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


# Keys every dump holds.
REQUIRED_KEYS = (VERSION_KEY, "canary", "req_to_token", "req_pool_indices", "seq_lens")
# Every key the format defines (docs/dump-format.md), besides the real-KV sources real_kv_N.
KNOWN_KEYS = (*REQUIRED_KEYS, "block_table", "block_size", "launch_tag", "real_kv_params",
              "real_kv_hash_mode", "swa_window_size", "full_to_swa_index_mapping",
              "expected_tokens", "expected_tokens_valid_lens", "sweep_slot_indices",
              "sweep_prev_slot_indices", "sweep_positions")
REAL_KV_PREFIX = "real_kv_"
# Keys the format leaves to their writers: the user's own, and kvcanary synth's metadata.
# The audit carries them through (Dump.extra) and checks nothing in them.
USER_KEY_PREFIX = "user_"
SYNTH_KEY_PREFIX = "synth_"


def check_key_names(path: str, keys) -> None:
    """Refuse a key the format does not define, naming the nearest one it does (a misspelt
    optional key would otherwise be saved and silently ignored by the audit)."""
    for key in keys:
        if key in KNOWN_KEYS or key.startswith((REAL_KV_PREFIX, USER_KEY_PREFIX,
                                                SYNTH_KEY_PREFIX)):
            continue
        near = difflib.get_close_matches(key, KNOWN_KEYS, n=1, cutoff=0.6)
        hint = f"did you mean {near[0]}? " if near else ""
        raise DumpError(f"{path}: key {key}: not a dump key ({hint}keys of your own start "
                        f"with {USER_KEY_PREFIX}, e.g. {USER_KEY_PREFIX}{key}; "
                        "docs/dump-format.md lists every key)")


# Keys whose dtype is int64: narrower integers are widened on save and on load alike.
INT64_KEYS = (VERSION_KEY, "req_pool_indices", "seq_lens", "real_kv_params", "swa_window_size",
              "full_to_swa_index_mapping", "expected_tokens_valid_lens", "sweep_slot_indices",
              "sweep_prev_slot_indices", "sweep_positions")


# Keys the format defines (real_kv_* aside); synth_ keys carry a synthetic dump's ground
# truth. A reader skips every other key without reading it (an ignored key that inflates to
# gigabytes costs nothing).
KNOWN_KEYS = frozenset({
    VERSION_KEY, "canary", "req_to_token", "block_table", "block_size", "req_pool_indices",
    "seq_lens", "launch_tag", "real_kv_params", "real_kv_hash_mode", "swa_window_size",
    "full_to_swa_index_mapping", "expected_tokens", "expected_tokens_valid_lens",
    "sweep_slot_indices", "sweep_prev_slot_indices", "sweep_positions"})


def _read_key(key: str) -> bool:
    return key in KNOWN_KEYS or key.startswith((REAL_KV_PREFIX, SYNTH_PREFIX, USER_KEY_PREFIX))


def widen(values: dict) -> dict:
    """``values`` with the int64 keys' narrower integer arrays (int8..int32, uint8..uint32)
    as int64: every value fits, so nothing is lost. Other dtypes are left for the checker."""
    widened = dict(values)
    for key in INT64_KEYS:
        value = widened.get(key)
        if value is not None and value.dtype.kind in "iu" and value.dtype != np.int64 \
                and np.can_cast(value.dtype, np.int64):
            widened[key] = value.astype(np.int64)
    return widened


def validate(path: str, flavour: str, values: dict) -> Dump:
    """The one checker behind :func:`load` and :func:`save`: ``values`` (key -> numpy
    array, as read from a container) as a :class:`Dump`, or :class:`DumpError`."""
    if VERSION_KEY not in values:
        missing = ", ".join(key for key in REQUIRED_KEYS if key not in values)
        raise DumpError(f"{path}: not a kvcanary dump: it lacks the required key(s) {missing}")
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
    c.nonnegative("req_pool_indices", rows)
    c.nonnegative("seq_lens", seq_lens)
    # Positions past the table are findings (out of the table), but a length far past it is
    # a corrupt value that would make the audit enumerate up to 2**63 entries.
    dump = Dump(path=path, flavour=flavour, canary=canary, req_to_token=req_to_token,
                req_pool_indices=rows, seq_lens=seq_lens, block_table=block_table,
                block_size=block_size)
    # A row outside the table is a wrong dump, not a corrupt record: one error, not a finding
    # at every position of the row.
    table, table_key = (req_to_token, "req_to_token") if block_table is None else (
        block_table, "block_table")
    outside = np.flatnonzero(np.asarray(rows) >= table.shape[0])
    if outside.size:
        index = int(outside[0])
        c.fail("req_pool_indices", f"req_pool_indices[{index}] = {int(rows[index])} is outside "
                                   f"{table_key}, which has {table.shape[0]} rows")
    width = dump.table_positions
    over = np.flatnonzero((np.asarray(rows) != 0) & (np.asarray(seq_lens) > 2 * width))
    if over.size:
        index = int(over[0])
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

    for key, value in values.items():
        if key in KNOWN_KEYS or key.startswith(REAL_KV_PREFIX):
            continue
        if value.dtype.kind == "U" and value.ndim == 0 and _valid_unicode(value):
            value = str(value[()])  # (invalid unicode stays an array: audit ignores extras)
        dump.extra[key] = value
    return dump


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
    from .types import RealKvSource

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
    name = c.string("real_kv_hash_mode", array).strip().upper()
    if name not in RealKvHashMode.__members__:
        c.fail("real_kv_hash_mode", f"must be none, partial or all, got {name.lower()!r}")
    return RealKvHashMode[name]


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
    lens = c.get("expected_tokens_valid_lens", required=pool is not None)
    if lens is not None and pool is None:
        c.get("expected_tokens", required=True)
    if pool is None:
        return
    dump.expected_tokens = c.integer("expected_tokens", pool, (np.int32, np.int64), 2,
                                     (dump.slot_table.shape[0], None))
    dump.expected_tokens_valid_lens = c.integer("expected_tokens_valid_lens", lens, (np.int64,),
                                                1, (bs,))
    c.nonnegative("expected_tokens_valid_lens", lens)


def _load_sweep(c: _Checker, dump: Dump) -> None:
    keys = ("sweep_slot_indices", "sweep_prev_slot_indices", "sweep_positions")
    present = [k for k in keys if k in c.values]
    if not present:
        return
    arrays = [c.get(k, required=True) for k in keys]
    length = arrays[0].shape[0] if arrays[0].ndim == 1 else None
    arrays = [c.integer(key, array, (np.int64,), 1, (length,))
              for key, array in zip(keys, arrays)]
    c.nonnegative("sweep_positions", arrays[2])
    dump.sweep_slot_indices, dump.sweep_prev_slot_indices, dump.sweep_positions = arrays

