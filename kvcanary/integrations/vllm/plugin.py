"""The vLLM general plugin: kvcanary's guard in a deployment.

vLLM loads every entry point of the group ``vllm.general_plugins`` in each of its processes;
kvcanary's (name ``kvcanary``) is :func:`register`. With ``KVCANARY_VLLM=1`` it wraps
vLLM's ``Scheduler.__init__`` so that the scheduler the engine-core process builds is
guarded from its first step (worker processes build no scheduler: nothing happens there).
Without the variable the plugin does nothing. Options, by environment variable:

==============================  ===========================================================
``KVCANARY_VLLM``               ``1`` turns the guard on
``KVCANARY_VLLM_CHECK_TOKENS``  ``0`` turns the stored-token check off (default ``1``)
``KVCANARY_VLLM_ON_VIOLATION``  ``log`` (default) or ``raise`` (the step raises)
``KVCANARY_VLLM_RING``          violation ring capacity per launch (default 4096)
``KVCANARY_VLLM_DUMP``          a dump path: the last step is written there on exit
==============================  ===========================================================

Each new finding is one WARNING on the ``kvcanary`` logger whose text starts with SGLang's
``kv_canary violation:`` line, so ``kvcanary explain`` reads the engine's log. The supported
vLLM versions are checked when the guard starts; an unsupported one is logged and left
unguarded. The plugin never stops the engine: a guard that cannot start (an unsupported
version, a bad option, a failure of kvcanary's own) is an ERROR on the ``kvcanary`` logger
and the engine runs unguarded; a guard that fails later steps aside (see
:func:`kvcanary.integrations.vllm.guard`).
"""

from __future__ import annotations

import atexit
import logging
import os

from ...format.errors import GUARD_PREFIX

logger = logging.getLogger("kvcanary")

GUARDS: list = []       # the guards this process installed


def options() -> dict:
    """:func:`kvcanary.integrations.vllm.guard` keyword arguments from the environment."""
    from ...format.errors import GuardError
    from .guarding import ON_VIOLATION

    on_violation = os.environ.get("KVCANARY_VLLM_ON_VIOLATION", "log")
    if on_violation not in ON_VIOLATION:
        raise GuardError(f"KVCANARY_VLLM_ON_VIOLATION must be 'log' or 'raise', "
                         f"got {on_violation!r}")
    check = os.environ.get("KVCANARY_VLLM_CHECK_TOKENS", "1")
    if check not in ("0", "1"):
        raise GuardError(f"KVCANARY_VLLM_CHECK_TOKENS must be 0 or 1, got {check!r}")
    ring = os.environ.get("KVCANARY_VLLM_RING", "4096")
    try:
        ring_capacity = int(ring)
    except ValueError:
        raise GuardError(f"KVCANARY_VLLM_RING must be an integer, got {ring!r}") \
            from None
    return dict(check_tokens=check == "1", on_violation=on_violation,
                ring_capacity=ring_capacity)


def register() -> None:
    """vLLM's entry point: install the guard hook when ``KVCANARY_VLLM=1`` (idempotent: vLLM
    may load plugins several times in one process)."""
    if os.environ.get("KVCANARY_VLLM") != "1":
        return
    try:
        _hook_scheduler()
    except Exception:   # vLLM calls general plugins unguarded: never stop its start
        logger.exception("%sthe vLLM plugin could not hook the scheduler; the engine runs "
                         "unguarded", GUARD_PREFIX)


def _hook_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.__init__, "_kvcanary", False):
        return
    original = Scheduler.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _install(self)

    __init__._kvcanary = True
    __init__.__wrapped__ = original
    Scheduler.__init__ = __init__


def _install(scheduler) -> None:
    from ...format.errors import GuardError
    from .guarding import guard

    try:
        g = guard(scheduler, **options())
        g.__enter__()
    except GuardError as exc:      # a setup the guard refuses, said in its own words
        logger.error("%s; the engine runs unguarded", exc)
        return
    except Exception:              # a failure of kvcanary's own: loud, with its traceback
        logger.exception("%sthe guard could not start on vLLM's scheduler; the engine runs "
                         "unguarded", GUARD_PREFIX)
        return
    GUARDS.append(g)
    logger.info("%sguarding vLLM's scheduler (%d KV cache group(s))", GUARD_PREFIX,
                g.stats["groups"])
    if len(GUARDS) == 1:
        atexit.register(_at_exit)


def _at_exit() -> None:
    path = os.environ.get("KVCANARY_VLLM_DUMP")
    for index, g in enumerate(GUARDS):
        try:
            _close(g, index, path)
        except Exception:   # at exit too: a failure of its own never fails the process
            logger.exception("%sthe guard's exit report failed", GUARD_PREFIX)


def _close(g, index: int, path) -> None:
    summary = g.summary()
    aside = summary["stepped_aside"]
    logger.info("%s%d steps guarded, %d finding(s)%s", GUARD_PREFIX, summary["steps"],
                summary["findings"], "" if aside is None else
                "; it stepped aside: " + aside.removeprefix(GUARD_PREFIX))
    if path and g.session.last is not None:
        target = path if index == 0 else f"{path}.{index}"
        try:
            g.dump(target)
        except (OSError, ValueError) as exc:
            logger.error("%sthe dump %s could not be written: %s", GUARD_PREFIX, target, exc)
