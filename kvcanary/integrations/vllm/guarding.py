"""The vLLM guard: :func:`guard` checks the scheduler and the arguments and builds a
:class:`Guard`, the context manager that wraps the scheduler's ``schedule`` while its
``with`` block runs, hands each step's output to the :class:`~.session.Session`, merges its
sightings into findings and reports them."""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np

from ... import Merger, RealKvHashMode, Violation
from ...dump import save as save_dump
from ...format.consts import HASH_MODE_NAMES
from ...format.errors import GuardError
from ..findings import Finding, Sighting, deliver
from .session import Session

logger = logging.getLogger("kvcanary")

# Versions whose scheduler output and KV cache manager have the fields used here.
SUPPORTED_VERSIONS = ((0, 32), (0, 33))   # first and last supported minor, inclusive
SUPPORTED_RANGE = ">=0.32,<0.34"
ON_VIOLATION = ("log", "raise")


def supported_version(version: str) -> bool:
    """Whether ``version`` (a vLLM ``__version__``) lies in ``SUPPORTED_RANGE``."""
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return SUPPORTED_VERSIONS[0] <= major_minor <= SUPPORTED_VERSIONS[1]


def guard(scheduler, *, check_tokens: bool = True, on_violation="log",
          ring_capacity: int = 4096, model_runner=None, sources="v-all",
          hash_mode: str = "all") -> "Guard":
    """A guard for ``scheduler`` (a vLLM v1 ``Scheduler``); use it as a context manager.

    ``model_runner``: the model runner executing the scheduler's steps (in-process, e.g. a
    CPU worker's ``CPUModelRunner``) for the model-runner mode (:mod:`.runner`): records at
    the real ``slot_mapping``, fingerprints of the real KV bytes. ``sources`` (that mode
    only): the layers whose V rows the records fingerprint, ``"v-all"``, ``"v0"`` or a list
    of layer indices (every KV head of each); ``hash_mode``: ``"none"``, ``"partial"`` or
    ``"all"`` of each slot's bytes. In that mode a step is checked after its forward, so
    ``on_violation="raise"`` raises from the runner's ``execute_model``.

    ``check_tokens``: verify stored token ids against each request's tokens (finds a
    prefix-cache hit on another prefix's block). ``on_violation``: ``"log"`` (a WARNING on
    the ``kvcanary`` logger per new finding, its first line SGLang's ``kv_canary
    violation:`` line), ``"raise"`` (``schedule`` raises :class:`GuardError`) or a callable
    receiving each new :class:`~kvcanary.integrations.findings.Finding`.

    Raises :class:`GuardError` for a vLLM version outside ``SUPPORTED_RANGE``, a scheduler
    without a KV cache manager, or a bad argument. A failure inside the guard itself (a
    kvcanary bug, not a finding) never reaches the engine: the guard logs it once (an ERROR
    on the ``kvcanary`` logger, with its traceback), steps aside for the rest of the run (the
    engine's calls pass through unchecked, their results untouched) and says so in
    ``guard.stepped_aside`` and ``summary()["stepped_aside"]``."""
    import vllm

    if not supported_version(vllm.__version__):
        raise GuardError(f"vLLM {vllm.__version__} is not supported by "
                         f"kvcanary.integrations.vllm (supported: vllm{SUPPORTED_RANGE})")
    if not callable(on_violation) and on_violation not in ON_VIOLATION:
        raise GuardError("on_violation must be 'log', 'raise' or a callable, got "
                         f"{on_violation!r}")
    if not callable(getattr(scheduler, "schedule", None)) or \
            getattr(scheduler, "kv_cache_config", None) is None:
        raise GuardError("guard() needs a vLLM v1 Scheduler, got "
                         f"{type(scheduler).__name__}")
    sizes = {int(g.kv_cache_spec.block_size) for g in scheduler.kv_cache_config.kv_cache_groups}
    if len(sizes) != 1:
        raise GuardError(f"KV cache groups of different block sizes {sorted(sizes)} "
                         "are not supported")
    if int(ring_capacity) < 1:
        raise GuardError(f"ring_capacity must be >= 1, got {ring_capacity!r}")
    if hash_mode not in HASH_MODE_NAMES:
        raise GuardError(f"hash_mode must be one of {', '.join(HASH_MODE_NAMES)}, "
                         f"got {hash_mode!r}")
    if model_runner is not None and not callable(getattr(model_runner, "execute_model", None)):
        raise GuardError("model_runner must be a vLLM model runner (with execute_model), got "
                         f"{type(model_runner).__name__}")
    g = Guard(scheduler, bool(check_tokens), on_violation, int(ring_capacity))
    if model_runner is not None:
        from .runner import RunnerSession

        g.session = RunnerSession(g, scheduler, model_runner, sources,
                                  RealKvHashMode.from_name(hash_mode))
        g.stats["sources"] = len(g.session.real_kv)
    return g


class Guard:
    """Guards one scheduler while its ``with`` block runs (see :func:`guard`). Outside the
    block the scheduler is exactly as it was.

    Attributes
    ----------
    stepped_aside : GuardError or None
        Set when the guard itself failed (its cause the original exception): from then on
        it checks nothing and the engine runs unguarded.
    """

    def __init__(self, scheduler, check_tokens, on_violation, ring_capacity):
        self.scheduler = scheduler
        self.check_tokens = check_tokens
        self.on_violation = on_violation
        self.ring_capacity = ring_capacity
        self.merger = Merger(key=Sighting.key, kind=Finding)
        self.raw_rows = []
        self.stats = dict(steps=0, entries_verified=0, tokens_written=0, ring_rows=0,
                          rows_dropped=0, groups=len(scheduler.kv_cache_config.kv_cache_groups))
        self.step_times = deque(maxlen=1 << 16)   # guard seconds of the latest steps
        self.engine_times = deque(maxlen=1 << 16)  # model runner seconds (model-runner mode)
        self._scheduled = 0.0    # guard seconds spent at schedule, of the step to come
        self.session = Session(self, scheduler)
        self._inside = False
        self._error = None
        self.stepped_aside = None

    def __enter__(self) -> "Guard":
        if self._inside:
            raise GuardError("this guard is already active")
        s = self.scheduler
        self._had_own = "schedule" in s.__dict__
        self._own = s.__dict__.get("schedule")
        original = s.schedule

        def schedule(*args, **kwargs):
            out = original(*args, **kwargs)
            if self.stepped_aside is not None:
                return out
            start = time.perf_counter()
            self._error = None
            try:
                self.session.on_schedule(out)
            except Exception as exc:   # a bug in the guard must not stop the engine
                self.step_aside(exc, "at the scheduler's schedule")
                return out
            if hasattr(self.session, "install"):   # the step closes after the forward
                self._scheduled = time.perf_counter() - start
            else:
                self.step_times.append(time.perf_counter() - start)
            if self._error is not None:
                raise self._error
            return out

        schedule.__wrapped__ = original
        s.schedule = schedule
        if hasattr(self.session, "install"):
            self.session.install()
        self._inside = True
        return self

    def step_aside(self, exc: Exception, where: str) -> None:
        """The guard failed (``exc``, raised ``where``): log it once, loudly, with its
        traceback, and stop checking; the engine runs unguarded from here. A finding not
        yet raised is dropped with the step (it stays in :meth:`findings`)."""
        self._error = None
        if self.stepped_aside is not None:
            return
        error = GuardError(f"the guard failed {where} ({type(exc).__name__}: {exc}) after "
                           f"{self.stats['steps']} guarded step(s); it steps aside and the "
                           "engine runs unguarded from here")
        error.__cause__ = exc
        self.stepped_aside = error
        logger.error("%s", error, exc_info=(type(exc), exc, exc.__traceback__))

    def close_step(self, seconds: float) -> None:
        """Model-runner mode: the step's guard time is its schedule part and ``seconds``
        after the forward; a finding under ``on_violation="raise"`` raises here."""
        self.step_times.append(self._scheduled + seconds)
        self._scheduled = 0.0
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def __exit__(self, *exc) -> bool:
        if hasattr(self.session, "remove"):
            self.session.remove()
        if self._had_own:
            self.scheduler.schedule = self._own
        else:
            self.scheduler.__dict__.pop("schedule", None)
        self._inside = False
        return False

    def findings(self) -> list:
        """One :class:`~kvcanary.integrations.findings.Finding` per distinct problem, in
        order of first sight (``request_id`` is vLLM's; ``group`` the KV cache group)."""
        return self.merger.findings

    def violations(self) -> list:
        """Every raw ring row as ``(step, Violation)``, in the order the launches gave them."""
        return [(step, Violation.from_row(row)) for step, row in self.raw_rows]

    def summary(self) -> dict:
        """``steps``, ``entries_verified``, ``tokens_written``, ``findings``, ring rows,
        dropped rows, ``groups`` and the median guard time per step (``guard_ms_median``;
        ``guard.step_times`` holds the latest 65536 steps' seconds); in the model-runner mode
        also ``sources``, ``write_index_mismatches`` and the model runner's own median
        ``execute_model`` time (``engine_ms_median``); ``stepped_aside``: ``None``, or the
        text of the guard's own failure after which it stopped checking."""
        times = np.array(self.step_times or [0.0])
        out = dict(self.stats, findings=len(self.merger),
                   guard_ms_median=float(np.median(times) * 1e3),
                   stepped_aside=None if self.stepped_aside is None else str(self.stepped_aside))
        if self.engine_times:
            out["engine_ms_median"] = float(np.median(np.array(self.engine_times)) * 1e3)
        return out

    def dump(self, path) -> str:
        """Write the last guarded step (full-attention group 0) as a kvcanary dump."""
        if self.session.last is None:
            raise GuardError("guard.dump needs at least one guarded step")
        return save_dump(path, **self.session.dump_arrays())

    def report(self, finding) -> None:
        error = deliver(finding, self.on_violation, "KV-cache violation")
        if error is not None and self._error is None:
            self._error = error

