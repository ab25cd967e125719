"""multiprocessing's resource tracker, kept quiet while a worker pool runs.

A pool started with ``spawn`` has a resource tracker process beside it (it unlinks the pool's
semaphores should the command die). When that process is killed, the next use starts a new
one, which then prints a Python traceback for every semaphore the old one knew (five for a
pool of two workers) after a warning that "resources might leak", none of it about the
audit. Within :func:`quiet_resource_tracker` a tracker starts with its standard error on
the null device, the warning is not shown, and a restart is said in one line instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

from ..format.errors import GUARD_PREFIX

RESTART_WARNING = "resource_tracker: process died unexpectedly"
RESTART_NOTE = (f"{GUARD_PREFIX}warning: a helper process of the worker pool (multiprocessing's "
                "resource tracker) ended early; a new one took over and the work goes on")


def _is_tracker(args) -> bool:
    return any("resource_tracker" in str(arg) for arg in args)


@contextlib.contextmanager
def quiet_resource_tracker(note=None):
    """Within the block, resource trackers this process starts write nothing, and a
    restarted one is said once with ``note`` (default: :data:`RESTART_NOTE` on standard
    error). Python versions that start the tracker some other way are left as they are."""
    from multiprocessing import util

    original = getattr(util, "spawnv_passfds", None)
    if original is None:
        yield
        return
    say = note or (lambda: print(RESTART_NOTE, file=sys.stderr, flush=True))
    launches = [0]

    def spawnv_passfds(path, args, passfds):
        if not _is_tracker(args):
            return original(path, args, passfds)
        launches[0] += 1
        if launches[0] == 2:
            say()
        # The tracker inherits standard error: give it the null device for the instant it
        # takes to start (the tracker is started once, and again only after it died).
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
            return original(path, args, passfds)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(null)

    util.spawnv_passfds = spawnv_passfds
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=RESTART_WARNING, category=UserWarning)
        try:
            yield
        finally:
            util.spawnv_passfds = original
