"""Whole-or-nothing output: a file or directory is written under a temporary name beside its
target and renamed over it when complete, so a reader, an interrupt or a failure sees the
previous target or the complete new one, never a part."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile

from .interrupt import signals_held

TEMPORARY_SUFFIX = ".partial"


@contextlib.contextmanager
def replacing(path: str, *, directory: bool = False):
    """Yield a temporary path beside ``path`` (an empty file, or an empty directory when
    ``directory``) to write; when the block ends normally it replaces ``path``, a directory
    as a whole. On an exception, an interrupt included, the temporary is removed and
    ``path`` is left as it was. The result gets the mode ``path`` had, else the umask's.
    A symbolic link is followed (the file it names is replaced); a device or a pipe
    (``/dev/stdout``) cannot be replaced and is written in place."""
    path = os.path.realpath(path)
    if not directory and _special(path):
        yield path
        return
    folder, name = os.path.split(path)
    if directory:
        os.makedirs(folder, exist_ok=True)
        temporary = tempfile.mkdtemp(prefix=f".{name}.", suffix=TEMPORARY_SUFFIX, dir=folder)
    else:
        handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=TEMPORARY_SUFFIX,
                                             dir=folder)
        os.close(handle)
    try:
        yield temporary
        os.chmod(temporary, _mode_for(path, directory))
        if directory:
            _replace_directory(temporary, path)
        else:
            os.replace(temporary, path)
    except BaseException:
        _remove(temporary)
        raise


def _special(path: str) -> bool:
    """A device, a pipe or a socket: something that exists and is no file or directory."""
    return os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path))


def _mode_for(path: str, directory: bool) -> int:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return (0o777 if directory else 0o666) & ~umask


def _replace_directory(new: str, path: str) -> None:
    """Two renames and a removal, with SIGINT and SIGTERM held back so that no interrupt
    leaves ``path`` missing or the old directory behind under its temporary name."""
    if not os.path.lexists(path):
        os.rename(new, path)
        return
    old = new + ".old"
    with signals_held():
        os.rename(path, old)
        try:
            os.rename(new, path)
        except BaseException:
            os.rename(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)


def _remove(temporary: str) -> None:
    if os.path.isdir(temporary) and not os.path.islink(temporary):
        shutil.rmtree(temporary, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
