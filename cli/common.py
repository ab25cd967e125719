"""Shared pieces of the commands: the error boundary (exit 2, one sentence, no traceback)
and progress on stderr when stderr is a terminal."""

from __future__ import annotations

import contextlib
import sys
import time

import click

from .interrupt import progressed

EXIT_CLEAN, EXIT_VIOLATIONS, EXIT_ERROR = 0, 1, 2


def error_message(exc: BaseException) -> str:
    """One line for the user: the library's messages already name the file and key."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename:
        text = f"{exc.filename}: {exc.strerror or text}"
    first = text.splitlines()[0]
    return first.removeprefix("kv-canary: ")


def fail(message: str) -> None:
    click.echo(f"kvcanary: error: {message}", err=True)
    sys.exit(EXIT_ERROR)


@contextlib.contextmanager
def error_boundary():
    """Turn the errors a bad input or environment raises into exit 2 with one line."""
    from kvcanary.audit import AuditError
    from kvcanary.dump import DumpError
    from kvcanary.synth import SynthError

    try:
        yield
    except (DumpError, AuditError, SynthError, ValueError, OSError, TypeError,
            MemoryError) as exc:
        fail(error_message(exc))
    except ImportError as exc:
        fail(f"a needed package is missing: {error_message(exc)}")
    except RuntimeError as exc:  # CUDA runtime or compile errors: the environment
        fail(error_message(exc))


class Progress:
    """``label: done/total`` redrawn on stderr; silent when stderr is not a terminal."""

    def __init__(self, label: str, *, stream=None, force: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if force is None else force
        self.label = label
        self.last = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        progressed(self.label, done, total)   # how far an interrupt says it got
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        percent = 100.0 * done / total if total else 100.0
        self.stream.write(f"\r{self.label}: {done}/{total} ({percent:.0f}%)")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.enabled and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
