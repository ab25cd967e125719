"""The transformers guard: :func:`guard` checks the arguments and builds a :class:`Guard`, the
context manager that hooks the model's continuous batching (:mod:`.hooks`) while its ``with``
block runs, merges the sessions' sightings into findings and reports them."""

from __future__ import annotations

import logging
import numbers
from collections import deque

import numpy as np

from ... import Merger, RealKvHashMode, Violation
from ...backends.reference import chain_compiled, realkv_compiled
from ...dump import save as save_dump
from ...format.consts import HASH_MODE_NAMES
from ...format.errors import GUARD_PREFIX, GuardError
from ..findings import Finding, Sighting, deliver
from .groups import CacheSession, check_model
from .hooks import SUPPORTED_RANGE, Hooks, supported_version
from .manager import RAW_ROWS_KEPT, STEP_TIMES_KEPT

logger = logging.getLogger("kvcanary")

SOURCE_PRESETS = ("k0", "kv-all")
PLAN_FROM = ("read_indices", "block_table")
ON_VIOLATION = ("log", "raise")
HASH_MODES = HASH_MODE_NAMES


# Rows of the guard's violation ring: 64 bytes each, so 16M rows are 1 GiB.
MAX_RING_CAPACITY = 1 << 24


def guard(model, *, sources="k0", hash_mode="all", check_tokens: bool = True,
          plan_from: str = "read_indices", on_violation="log",
          ring_capacity: int = 4096) -> "Guard":
    """A guard for ``model``'s continuous batching; use it as a context manager.

    ``sources``: ``"k0"`` (layer 0's K rows), ``"kv-all"`` (K and V of every layer), a list
    of ``("k" | "v", layer_index)``, or ``()`` for none. ``hash_mode``: ``"none"``,
    ``"partial"`` or ``"all"`` (how much of each slot's KV bytes the record fingerprints).
    ``check_tokens``: verify stored token ids against each request's tokens. ``plan_from``:
    ``"read_indices"`` (verify exactly the slots attention gathers, and check that they agree
    with the block table) or ``"block_table"``. ``on_violation``: ``"log"`` (a WARNING on
    the ``kvcanary`` logger per new finding), ``"raise"`` (stop the generation;
    ``generate_batch`` raises :class:`GuardError`) or a callable receiving each new
    :class:`~kvcanary.integrations.findings.Finding`. ``ring_capacity``: violation rows kept
    per step, 1 to ``MAX_RING_CAPACITY``.

    Raises :class:`GuardError` for a transformers version outside ``SUPPORTED_RANGE``, a
    model whose layers are neither full nor sliding-window attention (or a window under 2
    tokens), or a bad argument. A failure inside the guard itself never fails the engine's
    requests: the guard logs it (ERROR on the ``kvcanary`` logger), steps aside for the rest
    of the call (the engine runs unguarded) and ``generate_batch`` then raises
    :class:`GuardError` naming it (the original exception as its cause)."""
    import transformers

    if not supported_version(transformers.__version__):
        raise GuardError(
            f"transformers {transformers.__version__} is not supported by "
            f"kvcanary.integrations.transformers (supported: transformers{SUPPORTED_RANGE})")
    if hash_mode not in HASH_MODES:
        raise GuardError(f"hash_mode must be one of {', '.join(HASH_MODES)}, "
                         f"got {hash_mode!r}")
    if plan_from not in PLAN_FROM:
        raise GuardError(f"plan_from must be one of {', '.join(PLAN_FROM)}, "
                         f"got {plan_from!r}")
    if not callable(on_violation) and on_violation not in ON_VIOLATION:
        raise GuardError("on_violation must be 'log', 'raise' or a callable, got "
                         f"{on_violation!r}")
    if isinstance(ring_capacity, bool) or not isinstance(ring_capacity, numbers.Integral) \
            or not 1 <= int(ring_capacity) <= MAX_RING_CAPACITY:
        raise GuardError(f"ring_capacity must be an integer from 1 to "
                         f"{MAX_RING_CAPACITY}, got {ring_capacity!r}")
    if not hasattr(model, "generate_batch") or not hasattr(model, "config"):
        raise GuardError(f"guard() needs a transformers model with generate_batch, "
                         f"got {type(model).__name__}")
    check_model(model.config.get_text_config())
    layers = int(model.config.get_text_config().num_hidden_layers)
    return Guard(model, _source_list(sources, layers), RealKvHashMode.from_name(hash_mode),
                 bool(check_tokens), plan_from, on_violation, int(ring_capacity))


def _source_list(sources, layers: int) -> tuple:
    if isinstance(sources, str):
        if sources == "k0":
            return (("k", 0),)
        if sources == "kv-all":
            return tuple((kind, layer) for layer in range(layers) for kind in ("k", "v"))
        raise GuardError(f"sources must be 'k0', 'kv-all' or a list of "
                         f"('k' | 'v', layer), got {sources!r}")
    out = []
    for index, item in enumerate(sources or ()):
        try:
            kind, layer = item
            layer = int(layer)
        except (TypeError, ValueError):
            raise GuardError(f"sources[{index}] must be ('k' | 'v', layer), "
                             f"got {item!r}") from None
        if kind not in ("k", "v") or not 0 <= layer < layers:
            raise GuardError(f"sources[{index}] = {item!r}: kind must be 'k' or 'v' "
                             f"and layer in [0, {layers})")
        out.append((kind, layer))
    return tuple(out)


# ------------------------------------------------------------------ the guard


class Guard:
    """Guards one model's continuous batching while its ``with`` block runs (see
    :func:`guard`). Outside the block, transformers is exactly as it was."""

    def __init__(self, model, sources, hash_mode, check_tokens, plan_from, on_violation,
                 ring_capacity):
        self.model = model
        self.sources = sources
        self.hash_mode = hash_mode if sources else RealKvHashMode.NONE
        self.check_tokens = check_tokens
        self.plan_from = plan_from
        self.on_violation = on_violation
        self.ring_capacity = ring_capacity
        self.merger = Merger(key=Sighting.key, kind=Finding)
        self.raw_rows = deque(maxlen=RAW_ROWS_KEPT)   # (step, int64 [8] row): the newest rows
        self.stats = dict(steps=0, entries_verified=0, tokens_written=0, ring_rows=0,
                          rows_dropped=0, blocks_copied=0, blocks_restored=0, sessions=0,
                          read_index_mismatches=0, write_index_mismatches=0)
        self.session = None
        self.error = None
        self._inside = False
        # (guard seconds, engine step seconds) of the newest guarded steps
        self.step_times = deque(maxlen=STEP_TIMES_KEPT)
        if getattr(getattr(model, "device", None), "type", "cpu") == "cpu":
            # numba's load or compile now, not in the first step
            chain_compiled.kernels()    # every launch's chain rounds
            if self.hash_mode != RealKvHashMode.NONE:
                realkv_compiled.kernel()

    # -- context manager

    def __enter__(self) -> "Guard":
        if self._inside:
            raise GuardError("this guard is already active")
        Hooks.add(self)
        self._inside = True
        model = self.model
        self._own_generate = model.__dict__.get("generate_batch")
        had_own = "generate_batch" in model.__dict__
        original = model.generate_batch

        def generate_batch(*args, **kwargs):
            self.error = None
            outputs = original(*args, **kwargs)
            if self.error is not None:
                raise self.error
            return outputs

        self._had_own_generate = had_own
        model.generate_batch = generate_batch
        return self

    def __exit__(self, *exc) -> bool:
        if not self._inside:
            raise GuardError("this guard was never entered (use it as `with guard:`)")
        if not self.stats["steps"] and exc[0] is None:
            logger.warning("%sthe guard saw no generate_batch step: only continuous batching "
                           "(model.generate_batch) is guarded, not model.generate()", GUARD_PREFIX)
        model = self.model
        if self._had_own_generate:
            model.generate_batch = self._own_generate
        else:
            model.__dict__.pop("generate_batch", None)
        Hooks.remove(self)
        self._inside = False
        return False

    # -- results

    def findings(self) -> list:
        """One :class:`~kvcanary.integrations.findings.Finding` per distinct problem, in
        order of first sight."""
        return self.merger.findings

    def violations(self) -> list:
        """Every raw ring row as ``(step, Violation)``, in the order the launches gave them."""
        return [(step, Violation.from_row(row)) for step, row in self.raw_rows]

    def summary(self) -> dict:
        """``steps`` (forward steps guarded), ``entries_verified``, ``tokens_written``,
        ``findings``, the ring rows, dropped rows, copied and restored blocks, and the median
        per step of the guard's time and of the engine's own step (``guard_ms_median``,
        ``engine_ms_median``; ``guard.step_times`` holds every step's pair in seconds), and
        ``cache_groups``: per cache group its ``name``, ``layers``, ``window`` (None for full
        attention), real-KV ``sources`` and ``entries_verified``."""
        times = np.array(self.step_times or [(0.0, 0.0)])
        groups = [] if self.session is None else self.session.describe()
        return dict(self.stats, findings=len(self.merger), cache_groups=groups,
                    guard_ms_median=float(np.median(times[:, 0]) * 1e3),
                    engine_ms_median=float(np.median(times[:, 1]) * 1e3))

    def dump(self, path, group: str | None = None) -> str:
        """Write the engine's last guarded step as a kvcanary dump (the container chosen by
        the suffix, as ``kvcanary.dump.save`` does): canary buffer, block table, live requests
        and their lengths, the real-KV sources and, with ``check_tokens``, the expected tokens.
        ``kvcanary audit`` of a clean run's dump is clean. ``group``: the cache group to dump
        (``"full_attention"`` or ``"sliding_attention"``; None: the model's first); a
        sliding-window group's dump holds each request's window, its size and the
        full-to-SWA table."""
        if self.session is None or self.session.last is None:
            raise GuardError("guard.dump needs at least one guarded step")
        return save_dump(path, **self.session.dump_arrays(group))

    # -- internals

    def time_step(self, guard_s: float, engine_s: float) -> None:
        self.step_times.append((guard_s, engine_s))

    def session_for(self, processor) -> "CacheSession":
        if self.session is None or self.session.cache is not processor.cache:
            self.session = CacheSession(self, processor.cache)
            self.stats["sessions"] += 1
        return self.session

    def report(self, finding) -> None:
        error = deliver(finding, self.on_violation, "KV-cache violation, generation stopped")
        if error is not None and self.error is None:
            self.error = error

