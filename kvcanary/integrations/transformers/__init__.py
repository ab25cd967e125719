"""Guard Hugging Face transformers' continuous batching (``model.generate_batch``) with kvcanary.

::

    from kvcanary.integrations import transformers as kvt

    guard = kvt.guard(model, sources="k0", hash_mode="all", check_tokens=True,
                      plan_from="read_indices", on_violation="log")
    with guard:
        outputs = model.generate_batch(inputs=prompts, generation_config=config)
    guard.findings()        # one Finding per distinct problem
    guard.summary()         # steps, entries verified, tokens written, findings, ...
    guard.dump("last.npz")  # the last step as a dump `kvcanary audit` reads

The parts, each its own module:

* :mod:`.hooks` -- where kvcanary hooks into the engine (only while the ``with`` block runs,
  only for the given model) and how transformers is restored on exit;
* :mod:`.session` -- kvcanary's state beside one engine cache, step by step: before the
  forward the plan (from the step's read indices or the allocator's block table) and the
  verify of every prefix slot the step reads; after it the write of the step's new tokens at
  the slots the engine's write indices really name; records copied on forks and carried
  through offloading; the dump;
* this module -- :func:`guard` and :class:`Guard`, which also wraps the model's
  ``generate_batch`` (an instance attribute, removed on exit), so that
  ``on_violation="raise"`` reaches the caller as :class:`GuardError`.

Canary slot of (block, offset) is ``block * page_size + offset``; the engine's physical row
index ``block * block_physical_stride + offset`` maps to it. Block 0 (the engine's read trash)
is kvcanary's null block. Real-KV sources are views of the engine's cache tensor (zero-copy):
layer ``i``'s K (or V) rows of every block. torch and transformers are imported in this package only.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

from ...findings.attribution import Merger
from ...format.consts import RealKvHashMode
from ...dump import save as save_dump
from ...format.violations import Violation
from ..findings import Finding, Sighting
from .hooks import SUPPORTED_RANGE, SUPPORTED_VERSIONS, GuardError, _Hooks, supported_version
from .manager import RAW_ROWS_KEPT, STEP_TIMES_KEPT
from .session import _Session

logger = logging.getLogger("kvcanary")

SOURCE_PRESETS = ("k0", "kv-all")
PLAN_FROM = ("read_indices", "block_table")
ON_VIOLATION = ("log", "raise")
HASH_MODES = {"none": RealKvHashMode.NONE, "partial": RealKvHashMode.PARTIAL,
              "all": RealKvHashMode.ALL}


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
    :class:`~kvcanary.integrations.findings.Finding`.

    Raises :class:`GuardError` for a transformers version outside ``SUPPORTED_RANGE`` or a
    bad argument."""
    import transformers

    if not supported_version(transformers.__version__):
        raise GuardError(
            f"kvcanary: transformers {transformers.__version__} is not supported by "
            f"kvcanary.integrations.transformers (supported: transformers{SUPPORTED_RANGE})")
    if hash_mode not in HASH_MODES:
        raise GuardError(f"kvcanary: hash_mode must be one of {', '.join(HASH_MODES)}, "
                         f"got {hash_mode!r}")
    if plan_from not in PLAN_FROM:
        raise GuardError(f"kvcanary: plan_from must be one of {', '.join(PLAN_FROM)}, "
                         f"got {plan_from!r}")
    if not callable(on_violation) and on_violation not in ON_VIOLATION:
        raise GuardError("kvcanary: on_violation must be 'log', 'raise' or a callable, got "
                         f"{on_violation!r}")
    if not hasattr(model, "generate_batch") or not hasattr(model, "config"):
        raise GuardError(f"kvcanary: guard() needs a transformers model with generate_batch, "
                         f"got {type(model).__name__}")
    layers = int(model.config.get_text_config().num_hidden_layers)
    return Guard(model, _source_list(sources, layers), HASH_MODES[hash_mode],
                 bool(check_tokens), plan_from, on_violation, int(ring_capacity))


def _source_list(sources, layers: int) -> tuple:
    if isinstance(sources, str):
        if sources == "k0":
            return (("k", 0),)
        if sources == "kv-all":
            return tuple((kind, layer) for layer in range(layers) for kind in ("k", "v"))
        raise GuardError(f"kvcanary: sources must be 'k0', 'kv-all' or a list of "
                         f"('k' | 'v', layer), got {sources!r}")
    out = []
    for index, item in enumerate(sources or ()):
        try:
            kind, layer = item
            layer = int(layer)
        except (TypeError, ValueError):
            raise GuardError(f"kvcanary: sources[{index}] must be ('k' | 'v', layer), "
                             f"got {item!r}") from None
        if kind not in ("k", "v") or not 0 <= layer < layers:
            raise GuardError(f"kvcanary: sources[{index}] = {item!r}: kind must be 'k' or 'v' "
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
        self._session = None
        self._error = None
        self._inside = False
        # (guard seconds, engine step seconds) of the newest guarded steps
        self.step_times = deque(maxlen=STEP_TIMES_KEPT)

    # -- context manager

    def __enter__(self) -> "Guard":
        if self._inside:
            raise GuardError("kvcanary: this guard is already active")
        _Hooks.add(self)
        self._inside = True
        model = self.model
        self._own_generate = model.__dict__.get("generate_batch")
        had_own = "generate_batch" in model.__dict__
        original = model.generate_batch

        def generate_batch(*args, **kwargs):
            self._error = None
            outputs = original(*args, **kwargs)
            if self._error is not None:
                raise self._error
            return outputs

        self._had_own_generate = had_own
        model.generate_batch = generate_batch
        return self

    def __exit__(self, *exc) -> bool:
        model = self.model
        if self._had_own_generate:
            model.generate_batch = self._own_generate
        else:
            model.__dict__.pop("generate_batch", None)
        _Hooks.remove(self)
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
        ``engine_ms_median``; ``guard.step_times`` holds every step's pair in seconds)."""
        times = np.array(self.step_times or [(0.0, 0.0)])
        return dict(self.stats, findings=len(self.merger),
                    guard_ms_median=float(np.median(times[:, 0]) * 1e3),
                    engine_ms_median=float(np.median(times[:, 1]) * 1e3))

    def dump(self, path) -> str:
        """Write the engine's last guarded step as a kvcanary dump (the container chosen by
        the suffix, as ``kvcanary.dump.save`` does): canary buffer, block table, live requests
        and their lengths, the real-KV sources and, with ``check_tokens``, the expected tokens.
        ``kvcanary audit`` of a clean run's dump is clean."""
        if self._session is None or self._session.last is None:
            raise GuardError("kvcanary: guard.dump needs at least one guarded step")
        return save_dump(path, **self._session.dump_arrays())

    # -- internals

    def _time_step(self, guard_s: float, engine_s: float) -> None:
        self.step_times.append((guard_s, engine_s))

    def _session_for(self, processor) -> "_Session":
        if self._session is None or self._session.cache is not processor.cache:
            self._session = _Session(self, processor.cache)
            self.stats["sessions"] += 1
        return self._session

    def _report(self, finding) -> None:
        if self.on_violation == "log":
            logger.warning("%s request=%s position=%d: %s", finding.log_line, finding.request_id,
                           finding.position, finding.explanation)
        elif self.on_violation == "raise":
            if self._error is None:
                self._error = GuardError(f"kvcanary: KV-cache violation, generation stopped: "
                                         f"{finding.describe()}", finding)
        else:
            self.on_violation(finding)


__all__ = ["GuardError", "Guard", "SUPPORTED_RANGE", "SUPPORTED_VERSIONS", "guard",
           "supported_version"]
