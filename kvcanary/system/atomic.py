"""Whole-or-nothing output: a file or directory is written under a temporary name beside its
target and renamed over it when complete, so a reader, an interrupt or a failure sees the
previous target or the complete new one, never a part."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import stat
import sys
import tempfile

from ..format.errors import GUARD_PREFIX
from .signals import Interrupted, interrupted_since, interrupts_raised, signals_held

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
    removed = remove_stale_temporaries(folder, name)
    if removed:
        print(f"{GUARD_PREFIX}removed {len(removed)} partial output(s) of writers that died: "
              f"{', '.join(removed)}", file=sys.stderr)
    # The writer's process id in the name: the next save can tell a dead writer's leftover
    # (SIGKILL leaves it) from a live concurrent writer's.
    prefix = f".{name}.{os.getpid()}."
    temporary, replaced, mark = None, False, interrupts_raised()
    try:
        with signals_held():   # a signal is raised once the name is known, so it is removed
            if directory:
                temporary = tempfile.mkdtemp(prefix=prefix, suffix=TEMPORARY_SUFFIX, dir=folder)
            else:
                handle, temporary = tempfile.mkstemp(prefix=prefix, suffix=TEMPORARY_SUFFIX,
                                                     dir=folder)
                os.close(handle)
        yield temporary
        os.chmod(temporary, _mode_for(path, directory))
        with signals_held():   # a signal held here is raised after the output is in place
            if directory:
                _replace_directory(temporary, path)
            else:
                os.replace(temporary, path)
            replaced = True
            _WRITTEN.count += 1
            _WRITTEN.last[path] = _WRITTEN.count
    except BaseException as exc:
        if replaced and isinstance(exc, Interrupted):
            exc.output_written = True
        if temporary is not None:
            _remove(temporary)
        swallowed = None if isinstance(exc, Interrupted) else interrupted_since(mark)
        if swallowed is not None:   # an interrupt the writer turned into an error of its own
            raise swallowed from exc
        raise


class _Written:
    """The outputs this process put in place: how many, and when each path last was."""

    count = 0
    last: dict = {}


_WRITTEN = _Written()


def outputs_written() -> int:
    """How many outputs :func:`replacing` has put in place in this process: a mark for
    :func:`written_since`."""
    return _WRITTEN.count


def written_since(path: str, mark: int) -> bool:
    """Whether :func:`replacing` put an output in place at ``path`` (links followed, as it
    follows them) after ``mark`` (:func:`outputs_written`): what an interrupt's message
    reports as written, whatever the signal cut after the rename."""
    return _WRITTEN.last.get(os.path.realpath(path), 0) > mark


def remove_stale_temporaries(folder: str, name: str) -> list:
    """Remove ``.NAME.PID.*.partial`` beside ``NAME`` whose writer ``PID`` is no longer
    running (a live writer's is left alone); returns the names removed."""
    removed = []
    start = f".{name}."
    try:
        entries = os.listdir(folder or ".")
    except OSError:
        return removed
    for entry in entries:
        if not (entry.startswith(start) and entry.endswith(TEMPORARY_SUFFIX)):
            continue
        pid = entry[len(start):].split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            _remove(os.path.join(folder, entry))
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # exists, owned by someone else
        return True
    return True


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
    """Put the directory ``new`` at ``path``: swapped in one atomic exchange where the
    system has one (Linux ``renameat2``), so ``path`` is never missing and concurrent savers
    each remove what they swapped out (the last exchange wins); else two renames with SIGINT
    and SIGTERM held back. A saver that finds ``path`` taken again by another saver between
    its steps retries; nothing is left behind under a temporary name."""
    for _ in range(_REPLACE_ATTEMPTS):
        if not os.path.lexists(path):
            try:
                os.rename(new, path)
                return
            except OSError as exc:   # another saver put its directory there first
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        if _exchange(new, path):
            shutil.rmtree(new, ignore_errors=True)   # the earlier directory, now at new
            return
        old = new + ".old"
        with signals_held():
            try:
                os.rename(path, old)
            except FileNotFoundError:   # another saver moved it away: start again
                continue
            try:
                os.rename(new, path)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    os.rename(old, path)
                    raise
                shutil.rmtree(new, ignore_errors=True)   # another saver won the race
            shutil.rmtree(old, ignore_errors=True)
            return
    raise OSError(errno.EBUSY, "other writers keep replacing the directory", path)


_REPLACE_ATTEMPTS = 100
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap two existing paths atomically; False where the system or file system cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOENT):
        return False
    raise OSError(code, os.strerror(code), b)


@functools.lru_cache(maxsize=1)
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


def _remove(temporary: str) -> None:
    if os.path.isdir(temporary) and not os.path.islink(temporary):
        shutil.rmtree(temporary, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
