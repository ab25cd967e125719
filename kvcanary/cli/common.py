"""Shared pieces of the commands: exit codes, the one error style (``kvcanary: error: ...``,
one line on stderr, exit 2, no traceback) and progress on stderr when it is a terminal."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time

import click

from kvcanary.synth import MAX_SEED

from .interrupt import progressed

EXIT_CLEAN, EXIT_VIOLATIONS, EXIT_ERROR = 0, 1, 2
# explain: the inputs were read but hold nothing the canary writes (not a clean result).
EXIT_NO_CANARY_OUTPUT = 3
ERROR_PREFIX = "kvcanary: error: "
SEED_RANGE = click.IntRange(0, MAX_SEED)
# -j: each worker is a process holding its own arrays; more than this is a typo, not a plan.
MAX_JOBS = 256
JOBS_RANGE = click.IntRange(1, MAX_JOBS)
# Redraw a progress line at most this often (seconds).
PROGRESS_INTERVAL_S = 0.1


def error_message(exc: BaseException) -> str:
    """One line for the user: the library's messages already name the file and key (a
    kvcanary error's ``detail``, its message without the prefix)."""
    text = str(getattr(exc, "detail", exc)).strip() or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename:
        text = f"{exc.filename}: {exc.strerror or text}"
    # One line whatever the text holds: a newline (in a path, say) joins rather than cuts the
    # reason off, and other control characters are shown escaped, never sent raw.
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return printable(line)


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def user_error(exc: BaseException) -> str | None:
    """The one-line message for an error that bad input or the environment raises (a bad
    dump or option, a missing package, a CUDA runtime or compile error); None for anything
    else, which is a bug and keeps its traceback."""
    if isinstance(exc, ImportError):
        return f"a needed package is missing: {error_message(exc)}"
    if isinstance(exc, (ValueError, OSError, TypeError, MemoryError, RuntimeError)):
        return error_message(exc)   # CanaryError (DumpError...) is a ValueError
    return None


# What writing to a full disk, past a file-size limit or into a closed pipe raises.
OUTPUT_ERRNOS = (errno.EPIPE, errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EIO)


def output_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is standard output failing: a write error that names no file (the
    library names the file of every dump or report it writes)."""
    return isinstance(exc, OSError) and exc.filename is None and exc.errno in OUTPUT_ERRNOS


def end_output(exc: OSError) -> None:
    """Stop after standard output failed: quietly for a closed pipe, else one line naming
    it; exit 2 either way. What stdout still buffers goes nowhere, so the interpreter's
    final flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    if isinstance(exc, BrokenPipeError):
        sys.exit(EXIT_ERROR)
    fail(f"standard output: {exc.strerror or exc}")


def require_output_folder(path: str, option: str) -> None:
    """Fail now (before any work) when the folder that is to hold ``path`` is missing or not
    writable; the message names the option and the folder, never a temporary file. A link
    is written where it points, so its target's folder is the one checked."""
    target = os.path.realpath(path) if os.path.islink(path) else path
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        link = f" (a link to {target})" if target != path else ""
        fail(f"{option} {path}{link}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        fail(f"{option} {path}: the folder {folder} is not writable")


def fail(message: str) -> None:
    click.echo(f"{ERROR_PREFIX}{message}", err=True)
    sys.exit(EXIT_ERROR)


@contextlib.contextmanager
def error_boundary():
    """Turn the errors a bad input or environment raises into exit 2 with one line."""
    try:
        yield
    except Exception as exc:
        if output_failed(exc):
            end_output(exc)
        message = user_error(exc)
        if message is None:
            raise
        fail(message)


def refuse_output_among_inputs(output: str | None, inputs, option: str = "--html") -> None:
    """One error line (exit 2) when ``output`` is one of ``inputs`` or inside an input that
    is a directory (a directory dump): writing it would replace what is being read. Both
    sides are compared where their links lead, since the output is written where its link
    points."""
    if output is None:
        return
    target = os.path.realpath(output)
    for path in inputs:
        if path == "-":
            continue
        source = os.path.realpath(path)
        inside = os.path.isdir(source) and os.path.commonpath([source, target]) == source
        if target == source or inside:
            what = "is" if target == source else "is inside"
            fail(f"{option} {printable(output)}: {what} the input {printable(path)}; "
                 "an input is never written: choose another path")


class Progress:
    """``label: done/total (percent)`` redrawn on stderr; silent when stderr is not a
    terminal. The last draw is always the final count, so 100% shows exactly once, at the
    end."""

    def __init__(self, label: str, *, stream=None, force: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if force is None else force
        self.label = label
        self.last = 0.0
        self.drawn = None

    def __call__(self, done: int, total: int) -> None:
        progressed(self.label, done, total)   # how far an interrupt says it got
        if not self.enabled or (done, total) == self.drawn:
            return
        now = time.monotonic()
        if done < total and now - self.last < PROGRESS_INTERVAL_S:
            return
        self.last = now
        percent = 100 * done // total if total else 100   # rounded down: 100 means done
        self.drawn = (done, total)   # before the write: close() ends a line an interrupt cut
        self.stream.write(f"\r{self.label}: {done}/{total} ({percent}%)")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
