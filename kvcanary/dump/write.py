"""Writing a dump: values brought to the host, checked by the same checker as :func:`load`,
written under a temporary name and renamed when complete."""

from __future__ import annotations

import os
import re
import stat

import numpy as np

from ..model.arrays import as_array
from ..system.atomic import replacing
from .check import validate
from .model import DUMP_VERSION, VERSION_KEY, DumpError, check_key_names, flavour_of, widen
from .read import reason_of, require_safetensors, shown_name


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_]+")


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
            raise DumpError(f"{path}: key {shown_name(key)!r}: a key is a plain name (letters, "
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
        require_safetensors(path)
    # Written under a temporary name and renamed when complete: an interrupt or an error
    # leaves the earlier dump at ``path`` (or nothing), never a part of the new one.
    try:
        _write(path, flavour, values)
    except DumpError:
        raise
    except Exception as exc:   # a full disk, a file-size limit, an unwritable folder
        if not isinstance(exc, OSError) and type(exc).__name__ != "SafetensorError":
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else reason_of(exc)
        raise DumpError(f"{path}: cannot write the dump ({reason})") from None
    return path


# The longest file name most file systems hold (bytes).
_NAME_MAX = 255


def _write(path: str, flavour: str, values: dict) -> None:
    if flavour == "npz":
        with replacing(path) as temporary, open(temporary, "wb") as handle:
            np.savez(handle, **values)
    elif flavour == "dir":
        _check_replaceable_directory(path)
        for key in values:   # before anything is created: a name the system cannot hold
            if len(os.fsencode(f"{key}.npy")) > _NAME_MAX:
                raise DumpError(f"{path}: key {key[:40]}...: too long for a file name in a "
                                f"directory dump (at most {_NAME_MAX - 4} bytes; an .npz "
                                "holds it)")
        with replacing(path, directory=True) as temporary:
            for key, array in values.items():
                _save_npy(path, temporary, f"{key}.npy", array)
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


class _Writes:
    """A file as numpy sees a stream: ``np.save`` then writes it with ``write`` calls, whose
    errors keep their errno (a full disk is ENOSPC), where its own ``tofile`` on a real file
    reports a short write as "N requested and M written" with no cause."""

    def __init__(self, handle):
        self.write = handle.write


def _save_npy(path: str, folder: str, name: str, array: np.ndarray) -> None:
    """One key of a directory dump, a failed write named by its file and its cause."""
    try:
        with open(os.path.join(folder, name), "wb") as handle:
            np.save(_Writes(handle), array, allow_pickle=False)
    except OSError as exc:
        raise DumpError(f"{path}: cannot write the dump ({name}: "
                        f"{exc.strerror or reason_of(exc)})") from None


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
        require_safetensors(name)
    return flavour
