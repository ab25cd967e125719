"""Stopping at once on Ctrl-C or SIGTERM.

Inside :func:`signals_raise` the first SIGINT or SIGTERM raises :class:`Interrupted` in the
main thread (later ones are ignored while the program unwinds). :class:`WorkerPool` runs tasks
in processes that ignore SIGINT - a terminal sends it to the whole process group, and the
parent decides what happens - and kills them when the parent stops early, so no worker runs on
after it and none is replaced by a fresh one waiting for tasks that will never come.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures.process import BrokenProcessPool

from .tracker import quiet_resource_tracker

# SIGHUP (the terminal went away) and SIGQUIT stop a command too: their default action
# would end it without removing an output still under its temporary name.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                     if hasattr(signal, name))
WORKER_EXIT_WAIT_S = 2.0   # a killed worker is gone in milliseconds; never wait forever


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that handlers
    of ordinary errors let it through."""

    def __init__(self, signum: int):
        self.signum = signum
        # set when the signal arrived just after an output was put in place (see
        # kvcanary.system.atomic.replacing): that output is written, whatever was cut after it
        self.output_written = False
        super().__init__(self.signal_name)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """The shell's convention for a signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


@contextlib.contextmanager
def signals_raise():
    """Make SIGINT, SIGTERM, SIGHUP and SIGQUIT raise :class:`Interrupted` inside the block. A signal the
    process was started to ignore (``nohup``) stays ignored; outside the main thread, where
    Python cannot install handlers, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def handler(signum, frame):
        for s in previous:   # unwinding (killing workers, a last record) must not be cut
            signal.signal(s, signal.SIG_IGN)
        if _HOLD.depth:   # it arrived just before the hold and is handled inside it
            _HOLD.pending = signum
            return
        raise _raised(signum)

    for s, old in previous.items():
        if old is not signal.SIG_IGN:
            signal.signal(s, handler)
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, signal.SIG_DFL if old is None else old)


class _Hold:
    """The main thread's holds: how deep, and the stop signal that came during one; and the
    interrupts raised so far (how many, the last signal)."""

    depth = 0
    pending = None
    raised = 0
    last = None


_HOLD = _Hold()


def _raised(signum: int) -> Interrupted:
    _HOLD.raised += 1
    _HOLD.last = signum
    return Interrupted(signum)


def interrupts_raised() -> int:
    """How many :class:`Interrupted` this process has raised: a mark for
    :func:`interrupted_since`."""
    return _HOLD.raised


def interrupted_since(mark: int) -> Interrupted | None:
    """An :class:`Interrupted` for the last stop signal raised after ``mark``, or None. Code
    that the interrupt unwound through may have turned it into an error of its own (numpy's
    ``tofile`` raises ``TypeError`` when an exception interrupts it): the caller raises this
    instead, so the command stops as interrupted, not with that error."""
    return Interrupted(_HOLD.last) if _HOLD.raised > mark else None


@contextlib.contextmanager
def signals_held():
    """Hold the stop signals back (their :class:`Interrupted` is raised when the block ends)
    around steps that must not be separated, such as two renames, or a rename and noting
    that it happened. Both halves of a signal are held: its delivery (blocked in the calling
    thread; threads it starts inherit the block), and in the main thread a signal delivered
    just before the block whose Python handler would otherwise run, and raise, inside it.
    Only the main thread raises :class:`Interrupted` (:func:`signals_raise`)."""
    main = threading.current_thread() is threading.main_thread()
    blocked = hasattr(signal, "pthread_sigmask")
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if blocked else None
    if main:
        _HOLD.depth += 1
    try:
        yield
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if main:
            _HOLD.depth -= 1
            pending, _HOLD.pending = (_HOLD.pending, None) if not _HOLD.depth else (None,) * 2
            if pending is not None:
                raise _raised(pending)


def _worker_started(parent: int) -> None:
    """A worker ignores SIGINT, dies of SIGTERM, and dies with its parent (a parent killed
    by SIGKILL cannot stop it otherwise). It starts with SIGINT and SIGTERM held back (see
    :meth:`WorkerPool.map`), so neither can land while it is still importing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # a forked worker inherits the parent's
    _die_with_parent(parent)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent ends; elsewhere nothing. A parent that
    ended before the request took effect is noticed by the changed parent id."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def _give_up(task, failed, exc):
    if failed is None:
        raise exc
    return failed(task, exc)


class WorkerPool:
    """``map`` over tasks in ``jobs`` processes (in this process when ``jobs`` is 1). Use it
    as a context manager: leaving the block normally waits for the workers to finish; leaving
    it with an exception (an interrupt, an error) kills them and returns at once. Workers die
    with the process that started them."""

    def __init__(self, jobs: int, *, start_method: str = "spawn"):
        self._executor = None
        self._jobs, self._context = jobs, multiprocessing.get_context(start_method)
        self._retries: list = []   # the single-worker executors of retried tasks
        self._quiet = contextlib.ExitStack()
        if jobs > 1:
            # A killed resource tracker is one line, not a traceback per semaphore.
            self._quiet.enter_context(quiet_resource_tracker())
            self._executor = self._new_executor(jobs)

    def _new_executor(self, workers: int):
        return concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=self._context, initializer=_worker_started,
            initargs=(os.getpid(),))

    def map(self, function, tasks, *, failed=None):
        """``function(task)`` for every task, yielded in task order as each is ready. A task
        that raised, or whose worker died (killed, out of memory), gives ``failed(task, exc)``
        when ``failed`` is given, and raises otherwise. A dead worker takes every task of the
        pool down with it; each of those runs once more in a fresh worker of its own, so
        only the task that kills its worker again fails."""
        if self._executor is None:
            results = [functools.partial(function, task) for task in tasks]
        else:
            with signals_held():   # workers are started here: they inherit the hold
                futures = [self._executor.submit(function, task) for task in tasks]
            results = [future.result for future in futures]
        retried = None
        try:
            # Tasks left over when the caller stops early are cancelled by leaving the
            # pool's block, not here: the pool's own thread must see the cancellation.
            for index, task in enumerate(tasks):
                try:
                    outcome = results[index]()
                except BrokenProcessPool as exc:
                    if retried is not None:   # it broke its own fresh worker too
                        outcome = _give_up(task, failed, exc)
                    else:   # the pool is broken: so is every task it still owed
                        retried = concurrent.futures.ThreadPoolExecutor(self._jobs)
                        for later in range(index, len(tasks)):
                            if isinstance(futures[later].exception(), BrokenProcessPool):
                                results[later] = retried.submit(
                                    self._run_alone, function, tasks[later]).result
                        try:
                            outcome = results[index]()
                        except Exception as again:
                            outcome = _give_up(task, failed, again)
                except Exception as exc:
                    outcome = _give_up(task, failed, exc)
                yield outcome
        finally:
            if retried is not None:
                retried.shutdown(wait=False, cancel_futures=True)

    def _run_alone(self, function, task):
        """``function(task)`` in a fresh single-worker pool."""
        executor = self._new_executor(1)
        self._retries.append(executor)
        try:
            with signals_held():
                future = executor.submit(function, task)
            return future.result()
        finally:
            executor.shutdown(wait=True)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if self._executor is None:
            return
        try:
            if kind is not None:
                self._kill_workers()
            self._executor.shutdown(wait=True, cancel_futures=True)
        finally:
            self._quiet.close()

    def _kill_workers(self) -> None:
        for executor in (self._executor, *self._retries):
            self._kill(executor)

    @staticmethod
    def _kill(executor) -> None:
        kill = getattr(executor, "kill_workers", None)   # Python 3.14
        if kill is not None:
            kill()
            return
        processes = list((executor._processes or {}).values())
        for process in processes:
            process.kill()
        for process in processes:
            process.join(WORKER_EXIT_WAIT_S)
