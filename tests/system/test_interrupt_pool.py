"""The pieces behind a clean stop: SIGINT and SIGTERM raise once and the handlers come back;
pool workers ignore SIGINT, and are killed, not waited for, when the caller stops early."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from kvcanary.system.signals import Interrupted, WorkerPool, signals_raise

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="fork, signals and /proc: Linux only")


def test_signals_raise_once_then_restore():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as caught:
        with signals_raise():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)           # the handler raises here, at once
            finally:
                os.kill(os.getpid(), signal.SIGINT)   # while unwinding: ignored
                time.sleep(0.05)
    assert caught.value.exit_status == 143 and caught.value.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_ignored_from_the_start_stays_ignored():
    """``nohup`` and background jobs of a shell start with SIGINT ignored."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with signals_raise():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_pool_kills_its_workers_when_the_caller_stops_early():
    """spawn: this process may hold threads (JAX) that make fork unsafe; the CLI tests run
    the campaign's forked workers in a process of their own."""
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="caller stops"):
        with WorkerPool(2, start_method="spawn") as pool:
            results = pool.map(_pid_after, [0.0, 0.0, 60.0, 60.0, 60.0])
            workers = {next(results), next(results)}
            raise RuntimeError("caller stops")
    assert time.monotonic() - started < 20   # not the 60 s tasks
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in workers), workers


def test_pool_workers_ignore_sigint_and_report_a_dead_worker():
    # A test run started with SIGINT ignored (nohup, a background job) would hand that to
    # the workers, and the check would pass whatever they do: start them from a handler.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with WorkerPool(2, start_method="spawn") as pool:
            assert list(pool.map(signal.getsignal, [signal.SIGINT] * 2)) == [signal.SIG_IGN] * 2
    finally:
        signal.signal(signal.SIGINT, before)
    with WorkerPool(2, start_method="spawn") as pool:
        (outcome,) = pool.map(os._exit, [3], failed=lambda task, exc: ("failed", task))
    assert outcome == ("failed", 3)


@pytest.mark.parametrize("jobs", [1, 2])
def test_pool_reports_a_task_that_raised_in_order(jobs):
    with WorkerPool(jobs, start_method="spawn") as pool:
        outcomes = list(pool.map(int, ["1", "x", "3"], failed=lambda task, exc: ("failed", task)))
    assert outcomes == [1, ("failed", "x"), 3]
    with pytest.raises(ValueError), WorkerPool(jobs, start_method="spawn") as pool:
        list(pool.map(int, ["x"]))


TRACKER_KILLED = r"""
import os, signal, time
from kvcanary.system.signals import WorkerPool

def trackers():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"resource_tracker" in command:
            found.append(int(pid))
    return found

with WorkerPool(2) as pool:
    results = pool.map(time.sleep, [0.05] * 6)
    next(results)
    (tracker,) = trackers()
    os.kill(tracker, signal.SIGKILL)
    os.waitpid(tracker, 0)
    list(results)
print("done")
"""


def test_a_killed_resource_tracker_is_one_line_not_a_traceback_per_semaphore():
    import subprocess

    from kvcanary.system.tracker import RESTART_NOTE

    done = subprocess.run([sys.executable, "-c", TRACKER_KILLED], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    assert done.stderr == RESTART_NOTE + "\n"
