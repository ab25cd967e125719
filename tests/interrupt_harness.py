"""Run a ``kvcanary`` command in its own process group, wait until it shows progress, send a
signal to the whole group (as a terminal does on Ctrl-C) and record how it stopped; and
:func:`snapshot`, to show that an interrupted command left its folder as it was."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

READY_TIMEOUT_S = 120.0   # generous: the machine may be shared; a hang still fails
EXIT_TIMEOUT_S = 15.0     # a command that has not stopped by then has hung
GONE_TIMEOUT_S = 5.0
PROGRESS_LINE = re.compile(r"^.+: \d+/\d+ \(\d+%\)$")


@dataclass
class Stopped:
    returncode: int
    stop_s: float            # from the signal to the command's exit
    stdout: str
    stderr: str
    group: list              # pids in the command's session when the signal was sent
    alive: list              # pids still running in that session after the command exited

    def messages(self) -> list:
        """stderr lines other than progress redraws."""
        lines = []
        for line in self.stderr.replace("\r\n", "\n").split("\n"):
            shown = line.rsplit("\r", 1)[-1]
            if shown and not PROGRESS_LINE.match(shown):
                lines.append(shown)
        return lines


def snapshot(folder) -> dict:
    """Every file under ``folder`` with a digest of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _stat(pid: int):
    """``(state, session)`` of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[3])


def _running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def session_members(session: int) -> list:
    """Running (not zombie) processes of a session."""
    stats = {int(name): _stat(int(name)) for name in os.listdir("/proc") if name.isdigit()}
    return sorted(pid for pid, stat in stats.items()
                  if stat is not None and stat[0] != "Z" and stat[1] == session)


class _Reader(threading.Thread):
    def __init__(self, fd: int):
        super().__init__(daemon=True)
        self.fd, self.chunks, self.lock = fd, [], threading.Lock()
        self.start()

    def run(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:   # EIO: the terminal's last writer has gone
                break
            if not data:
                break
            with self.lock:
                self.chunks.append(data)

    def text(self) -> str:
        with self.lock:
            return b"".join(self.chunks).decode("utf-8", "replace")


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(args, sig: int, ready: str, *, cwd, stderr_tty: bool = True,
              ready_on: str = "stderr", min_processes: int = 1) -> Stopped:
    """Start ``kvcanary ARGS`` in a new session, wait for ``ready`` (a regex) on its
    ``ready_on`` stream, send ``sig`` to its process group and wait for it to stop. With
    ``stderr_tty`` its stderr is a terminal, so the progress bars draw."""
    command = [sys.executable, "-c", "from kvcanary.cli import main; main()", *map(str, args)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    if stderr_tty:
        import pty   # POSIX only

        err_read, err_write = pty.openpty()
    else:
        err_read, err_write = os.pipe()
    out_read, out_write = os.pipe()
    # The command starts with SIGINT at its default even when this test run ignores it
    # (nohup, a background job): else an interrupt test would pass whatever workers do.
    process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                               stdout=out_write, stderr=err_write, start_new_session=True,
                               preexec_fn=_sigint_default)
    os.close(out_write)
    os.close(err_write)
    streams = {"stdout": _Reader(out_read), "stderr": _Reader(err_read)}
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not re.search(ready, streams[ready_on].text()):
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"no {ready!r} on {ready_on} before the signal (exit {process.poll()}):\n"
                    f"stdout: {streams['stdout'].text()[-2000:]}\n"
                    f"stderr: {streams['stderr'].text()[-2000:]}")
            time.sleep(0.02)
        group = session_members(process.pid)
        assert len(group) >= min_processes, f"only {group} running at the signal"
        sent = time.monotonic()
        os.killpg(process.pid, sig)
        try:
            process.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {EXIT_TIMEOUT_S} s after the signal:\n"
                                 f"stderr: {streams['stderr'].text()[-3000:]}") from None
        stop_s = time.monotonic() - sent
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while True:   # by pid, and anything else in the session (zombies are dead)
            alive = sorted({pid for pid in group if _running(pid)}
                           | set(session_members(process.pid)))
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for reader in streams.values():
            reader.join(GONE_TIMEOUT_S)
        return Stopped(process.returncode, stop_s, streams["stdout"].text(),
                       streams["stderr"].text(), group, alive)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for survivor in session_members(process.pid):
            os.kill(survivor, signal.SIGKILL)
        os.close(out_read)
        os.close(err_read)
