"""Reading a dump's container (``.npz``, a directory of ``.npy`` files, ``.safetensors``) into
``{key: array}`` without validation, within bounds on what its headers make the reader
allocate."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import struct
import time

import numpy as np

from .model import (SYNTH_KEY_PREFIX, USER_KEY_PREFIX, VERSION_KEY, DumpError, check_key_names,
                    flavour_of, is_read_key)


# safetensors dtype names numpy can represent; others are read as raw bytes.
_SAFETENSORS_NUMPY = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "F16": np.float16, "U32": np.uint32, "I32": np.int32, "F32": np.float32,
    "U64": np.uint64, "I64": np.int64, "F64": np.float64,
}


def require_safetensors(path: str) -> None:
    try:
        import safetensors.numpy  # noqa: F401
    except ImportError:
        raise DumpError(f"{path}: .safetensors dumps need the safetensors package "
                        "(pip install safetensors)") from None


# Bounds on what a container may make the loader allocate, checked before any allocation:
# a deflated member cannot expand more than deflate's ~1032:1; all members together may
# expand to at most MAX_NPZ_EXPANSION times the file (or MAX_NPZ_EXPANSION_FLOOR bytes,
# whichever is larger); a safetensors JSON header is at most 1 MiB (a dump's keys and
# strings take a few kilobytes; parsing the format's own limit of 100 MB costs gigabytes).
MAX_NPZ_EXPANSION = 256
MAX_NPZ_EXPANSION_FLOOR = 256 << 20
_DEFLATE_MAX_RATIO = 1032
MAX_SAFETENSORS_HEADER = 1 << 20
# A .npy header (a short dict literal) is at most numpy's own limit, checked before it is read:
# numpy reads the whole declared header (up to 4 GiB in format 2.0) before refusing it.
MAX_NPY_HEADER = 10000
_NPY_MAGIC = b"\x93NUMPY"


def _npy_layout(fp) -> tuple:
    """``(shape, dtype, header_bytes, data_bytes)`` of the ``.npy`` stream at ``fp``, read
    from its header alone (nothing is allocated for the data)."""
    from numpy.lib import format as npy_format

    start = fp.tell()
    version = npy_format.read_magic(fp)
    if version in ((1, 0), (2, 0)):
        width = 2 if version == (1, 0) else 4
        declared = fp.read(width)
        if len(declared) == width:
            length = int.from_bytes(declared, "little")
            if length > MAX_NPY_HEADER:
                raise ValueError(f"the .npy header declares {length} bytes, above the limit of "
                                 f"{MAX_NPY_HEADER} (a dump's headers are a short line)")
        fp.seek(start)
        npy_format.read_magic(fp)
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


def shown_name(name: str) -> str:
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
        raise DumpError(f"{path}: not a readable .npz file ({reason_of(exc)})") from None
    values = {}
    with archive:
        infos = archive.infolist()
        _check_zip_members(path, infos)
        for info in infos:
            name = info.filename.removesuffix(".npy")
            key = shown_name(name)
            if not is_read_key(name):
                values.setdefault(_UNKNOWN, []).append(key)
                continue
            with _reading(f"{path}: key {key}: cannot read"):
                with archive.open(info) as member:
                    shape, dtype, header, nbytes = _npy_layout(member)
                if header + nbytes != info.file_size:
                    raise DumpError(
                        f"{path}: key {key}: the .npy header declares "
                        f"{_describe(shape, dtype, nbytes)} but the archive member holds "
                        f"{max(0, info.file_size - header)} bytes of data")
                if name.startswith(_LAZY_PREFIXES):
                    values[name] = LazyMember(path, info.filename, key)
                    continue
                with archive.open(info) as member:
                    values[name] = npy_format.read_array(member, allow_pickle=False)
    return values


class LazyMember:
    """A ``user_``/``synth_`` member of an ``.npz`` whose header was checked and whose data is
    read only when someone asks for it (the audit never does: an unused key costs nothing)."""

    def __init__(self, path: str, member: str, key: str):
        self.path, self.member, self.key = path, member, key

    def load(self) -> np.ndarray:
        import zipfile

        from numpy.lib import format as npy_format

        with _reading(f"{self.path}: key {self.key}: cannot read"):
            with zipfile.ZipFile(self.path) as archive, archive.open(self.member) as member:
                return npy_format.read_array(member, allow_pickle=False)


_LAZY_PREFIXES = (SYNTH_KEY_PREFIX, USER_KEY_PREFIX)


def _check_zip_members(path: str, infos: list) -> None:
    """Refuse what would make reading the archive allocate or inflate more than the file can
    honestly hold: sizes a member's compression cannot produce, members past the end of the
    file or sharing their data (zip bombs), or too large a total expansion."""
    import zipfile

    size = os.path.getsize(path)
    spans, total, seen = [], 0, set()
    for info in infos:
        key = shown_name(info.filename.removesuffix(".npy"))
        where = f"{path}: key {key}:"
        if info.filename in seen:   # which one a reader takes is the zip library's choice
            raise DumpError(f"{where} the archive holds two members of this name")
        seen.add(info.filename)
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


def reason_of(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    text = text[0] if text else type(exc).__name__
    if "allow_pickle" in text or "Object arrays" in text:
        return "object (pickled) arrays are refused"
    if "malformed node or string" in text or "Cannot parse header" in text:
        return "the .npy header cannot be parsed (not a literal Python dict)"
    if "magic string is not correct" in text:   # (numpy's text echoes the file's bytes)
        return "not a .npy file: it does not start with the .npy magic number"
    return text


@contextlib.contextmanager
def _reading(where: str):
    """Any failure but a DumpError while reading as one DumpError: ``where (reason)``."""
    try:
        yield
    except DumpError:
        raise
    except Exception as exc:
        raise DumpError(f"{where} ({reason_of(exc)})") from None


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
        key, shown = shown_name(raw_key), os.path.join(path, shown_name(name))
        with _reading(f"{shown}: key {key}: cannot read"):
            _require_inside(path, through, name, shown, key)
            _require_regular(file, shown, key)
            if not is_read_key(raw_key):
                values.setdefault(_UNKNOWN, []).append(key)
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
                continue
            present = _present_rows(file, header, values[raw_key])
            if present is not None:
                values[raw_key].present_rows = present
    return values


# Holes of a sparse file shorter than this are read like data: merging them keeps the ranges
# few (a file with a hole every other block would otherwise give one range per block).
_HOLE_MERGE_BYTES = 1 << 20


def _present_rows(file: str, header: int, array) -> tuple | None:
    """The ``(begin, end)`` rows of a memory-mapped ``.npy`` that hold data, when the file
    has holes (a sparse file: its declared size costs no disk, and its holes read as zero);
    None when every row holds data or the system cannot say (no ``SEEK_DATA``)."""
    if not hasattr(os, "SEEK_DATA") or array.ndim == 0 or not array.shape[0] \
            or not array.flags.c_contiguous:
        return None
    row_bytes = array.nbytes // array.shape[0]
    if not row_bytes:
        return None
    end = header + array.nbytes
    extents = []
    with open(file, "rb") as handle:
        fd, offset = handle.fileno(), header
        while offset < end:
            try:
                begin = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:   # nothing but a hole to the end
                    break
                return None   # the system cannot say: every row is read
            begin = max(begin, offset)
            if begin >= end:
                break
            stop = min(end, os.lseek(fd, begin, os.SEEK_HOLE))
            if extents and begin - extents[-1][1] < _HOLE_MERGE_BYTES:
                extents[-1][1] = stop
            else:
                extents.append([begin, stop])
            offset = stop
    if len(extents) == 1 and extents[0][0] <= header and extents[0][1] >= end:
        return None
    return tuple(((b - header) // row_bytes, -(-(e - header) // row_bytes)) for b, e in extents)


def _read_safetensors(path: str) -> dict:
    require_safetensors(path)
    from safetensors import safe_open

    with _reading(f"{path}: not a readable .safetensors file"):
        header = _safetensors_header(path)
        values = {}
        with safe_open(path, framework="numpy") as handle:
            for key, value in (handle.metadata() or {}).items():
                if key != "__metadata__":
                    values[key] = np.array(value)
            for key in handle.keys():
                if not is_read_key(key):
                    values.setdefault(_UNKNOWN, []).append(shown_name(key))
                    continue
                info = header[key]
                if info["dtype"] in _SAFETENSORS_NUMPY:
                    values[key] = handle.get_tensor(key)
                else:
                    values[key] = _raw_tensor(path, header, key)
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


# Where a reader notes the keys it skipped unread (a key no string can be).
_UNKNOWN = object()


def read_raw(path) -> tuple[str, dict]:
    """``(flavour, {key: array})`` without validation, except that a kvcanary dump (one with
    the version key) holding a key the format does not define is refused, with the nearest
    name: a misspelt optional key would otherwise be skipped and the audit check less."""
    flavour, values = _read_raw(path)
    unknown = values.pop(_UNKNOWN, [])
    if unknown and VERSION_KEY in values:
        check_key_names(str(path), unknown[:1])
    return flavour, values


def _read_raw(path) -> tuple[str, dict]:
    path = str(path)
    try:
        os.stat(path)
    except OSError as exc:   # a missing file, a symbolic-link loop, an unsearchable folder
        raise DumpError(f"{shown_name(path)}: {(exc.strerror or 'cannot read').lower()}") from None
    if os.path.isdir(path):
        _refuse_a_folder_of_dumps(path)
        return "dir", _read_dir(path)
    _require_regular(path, shown_name(path))
    flavour = flavour_of(path)
    if flavour == "safetensors":
        return flavour, _read_safetensors(path)
    if flavour == "npz":
        return flavour, _read_npz(path)
    if path.endswith(".npy"):
        raise DumpError(f"{path}: a lone .npy file is one key of a directory dump: audit the "
                        "directory that holds it (one .npy file per key), or an .npz or "
                        ".safetensors file")
    raise DumpError(f"{path}: unknown dump container (expected .npz, .safetensors or a "
                    "directory of .npy files)")
