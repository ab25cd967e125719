"""Ctrl-C and SIGTERM for every command: the command stops at once and says, in one line on
stderr, what was interrupted and how far it got; the exit status is 130 for SIGINT and 143
for SIGTERM. A command reports how far it got through its progress bars, names the output an
interrupt leaves unwritten with :func:`unwritten`, and ends a JSON stream with
:func:`on_interrupt`."""

from __future__ import annotations

import contextlib
import functools
import sys

import click

from kvcanary.system.atomic import outputs_written, written_since
from kvcanary.system.signals import Interrupted, signals_raise


class Activity:
    """What the running command has done so far."""

    def __init__(self, command: str):
        self.command = command
        self.step = None            # (label, done, total) of the latest progress
        self.unwritten = []         # outputs the interrupt left unwritten
        self.closing = []           # callbacks(Interrupted) run before the line is printed

    def describe(self, exc: Interrupted) -> str:
        text = f"{self.command} interrupted by {exc.signal_name}"
        if self.step is not None:
            label, done, total = self.step
            text += f" ({label.removeprefix(self.command + ': ')}: {done}/{total})"
        return "; ".join([text] + [f"{what} not written" for what in self.unwritten])


_activity = Activity("kvcanary")


def progressed(label: str, done: int, total: int) -> None:
    """Record the latest progress (every progress bar calls this, drawn or not)."""
    _activity.step = (label, done, total)


@contextlib.contextmanager
def unwritten(what: str):
    """Inside the block an interrupt leaves the output ``what`` unwritten, and the line
    says so, unless the block had already put it in place (the signal cut what came after:
    the output is whole, and is not called unwritten)."""
    mark = outputs_written()
    try:
        yield
    except Interrupted as exc:
        if exc.output_written:   # it landed just after the output was put in place
            exc.output_written = False
        elif not written_since(what, mark):
            _activity.unwritten.append(what)
        raise


def on_interrupt(callback) -> None:
    """Call ``callback(exc)`` on an interrupt before the line is printed: e.g. the final
    record of a JSON stream, so a consumer can tell a cut report from a complete one."""
    _activity.closing.append(callback)


def interruptible(command: click.Command) -> click.Command:
    """Run the command's callback with SIGINT and SIGTERM turned into a clean stop."""
    callback = command.callback

    @functools.wraps(callback)
    def run(*args, **kwargs):
        global _activity
        _activity = Activity(command.name)
        with signals_raise():
            try:
                return callback(*args, **kwargs)
            except Interrupted as exc:
                with contextlib.suppress(OSError):   # a reader that has gone away
                    for close in _activity.closing:
                        close(exc)
                    sys.stdout.flush()
                click.echo(f"kvcanary: {_activity.describe(exc)}", err=True)
                sys.exit(exc.exit_status)

    command.callback = run
    return command


def interrupted_record(exc: Interrupted, **facts) -> dict:
    """The final record of an interrupted JSON stream."""
    record = {"record": "interrupted", "command": _activity.command, "signal": exc.signal_name}
    if _activity.step is not None:
        label, done, total = _activity.step
        record.update(at=label, done=done, total=total)
    return {**record, **facts}
