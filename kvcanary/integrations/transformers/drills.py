"""Fire drills: one fault injected into continuous batching's own state at a chosen step, so
that an operator (or a test) can see the guard's alert fire end to end.

A drill is ``KIND@STEP``; from engine step ``STEP`` on (the guard's step numbers, which its
findings' ``first_step`` carry too), the first step with a fitting target gets the fault, once:

* ``remap`` -- a decoding request's block-table entry of its last full block is pointed at
  another decoding request's (different) block;
* ``free-held`` -- a block a decoding request still holds goes back to the allocator's pool,
  so a later request is handed it and overwrites it;
* ``kv-flip`` -- one byte of layer 0's K row of a written slot is flipped in place;
* ``position-shift`` -- a decoding request's position offset moves on by one, so its next
  token is written into the slot of the position after it.

:class:`DrillSet` wraps ``ContinuousBatchingIOs.prepare_batch_tensors`` while it is
installed (only caches that a guard watches are touched) and restores it exactly on
:meth:`DrillSet.uninstall`. Each fired drill is logged as an ERROR on the ``kvcanary`` logger
and kept in :attr:`DrillSet.fired` with the request and position where the guard should
report it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from ...format.errors import GuardError
from .hooks import Hooks

logger = logging.getLogger("kvcanary")

DRILL_KINDS = ("remap", "free-held", "kv-flip", "position-shift")


@dataclass
class Drill:
    """One drill: ``kind`` (one of :data:`DRILL_KINDS`) from engine step ``step`` on.
    Once fired, ``fired_step``, ``request_id``, ``position`` (the request's position where
    the guard should report it), ``block`` and ``detail`` (what was done, in words) are set."""

    kind: str
    step: int
    fired_step: int | None = None
    request_id: str | None = None
    position: int | None = None
    block: int | None = None
    detail: str = ""

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("kind", "step", "fired_step", "request_id",
                                              "position", "block", "detail")}


def parse_drill(text: str) -> Drill:
    """``"KIND@STEP"`` as a :class:`Drill`; :class:`GuardError` names a bad one."""
    kind, at, step = str(text).partition("@")
    if kind not in DRILL_KINDS or not at or not step.isdigit() or int(step) < 1:
        raise GuardError(f"drill {text!r} must be KIND@STEP with KIND one of "
                         f"{', '.join(DRILL_KINDS)} and STEP a step number >= 1")
    return Drill(kind, int(step))


@dataclass
class DrillSet:
    """The drills of one run; :meth:`install` them before the engine runs."""

    drills: list
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _original: object = None

    @property
    def fired(self) -> list:
        return [d for d in self.drills if d.fired_step is not None]

    def install(self) -> "DrillSet":
        from transformers.generation.continuous_batching.input_outputs import (
            ContinuousBatchingIOs,
        )

        if self._original is not None or not self.drills:
            return self
        original = self._original = ContinuousBatchingIOs.__dict__["prepare_batch_tensors"]
        drills = self

        def prepare_batch_tensors(io, requests_in_batch, *args, **kwargs):
            drills._before(io, requests_in_batch)
            return original(io, requests_in_batch, *args, **kwargs)

        prepare_batch_tensors.__wrapped__ = original
        ContinuousBatchingIOs.prepare_batch_tensors = prepare_batch_tensors
        for d in self.drills:
            logger.warning("kvcanary drill armed: %s from engine step %d (a fault will be "
                           "injected on purpose)", d.kind, d.step)
        return self

    def uninstall(self) -> None:
        from transformers.generation.continuous_batching.input_outputs import (
            ContinuousBatchingIOs,
        )

        if self._original is not None:
            ContinuousBatchingIOs.prepare_batch_tensors = self._original
            self._original = None

    def _before(self, io, requests) -> None:
        sessions = Hooks.sessions_of(lambda s: s.cache is io.cache)
        session = sessions[0] if sessions else None
        if session is None and not Hooks.active:
            return                  # no guard: the engine is left alone
        # The guard's number of the step about to run (its findings carry the same).
        step = (0 if session is None else session.guard.stats["steps"]) + 1
        with self._lock:
            for d in self.drills:
                if d.fired_step is None and step >= d.step and _FIRE[d.kind](d, io, requests):
                    d.fired_step = step
                    logger.error("kvcanary drill fired at engine step %d: %s", step, d.detail)


def _allocator(io):
    return next(iter(io.cache.cache_allocators.values()))


def _decoding(io, requests, min_len: int) -> list:
    """Futures of decoding requests (one query token) at least ``min_len`` tokens long."""
    return [f for f in requests
            if f.query_length == 1 and f.state.generated_tokens
            and f.state.position_offset >= min_len]


def _remap(d, io, requests) -> bool:
    a = _allocator(io)
    page = a.tokens_per_page
    cands = _decoding(io, requests, page + 1)
    for v in cands:
        victim = v.state.request_id
        k = v.state.position_offset // page - 1            # its last full block
        for o in cands:
            table = a.block_table[o.state.request_id]
            if k < len(table) and table[k] != a.block_table[victim][k]:
                a.block_table[victim][k] = table[k]
                d.request_id, d.position, d.block = victim, k * page, int(table[k])
                d.detail = (f"block {k} of {victim}'s block table remapped onto "
                            f"{o.state.request_id}'s block {d.block}")
                return True
    return False


def _tokens_left(future) -> int:
    """How many more tokens the request may generate (a large number without a limit)."""
    limit = getattr(future.state, "max_new_tokens", None)
    return 1 << 30 if limit is None else limit - len(future.state.generated_tokens)


def _free_held(d, io, requests) -> bool:
    a = _allocator(io)
    page = a.tokens_per_page
    # The request that will hold the block longest: the pool has the most steps to hand the
    # block to someone else before the holder reads it for the last time.
    for f in sorted(_decoding(io, requests, page + 1), key=_tokens_left, reverse=True):
        rid = f.state.request_id
        full = f.state.position_offset // page      # blocks [0, full) are full
        block = int(a.block_table[rid][full - 1])
        a.pool.free_blocks(a.index, [block])
        d.request_id, d.block = rid, block
        d.position = (full - 1) * page
        d.detail = f"block {block} freed while {rid} still holds it"
        return True
    return False


def _kv_flip(d, io, requests) -> bool:
    a = _allocator(io)
    page = a.tokens_per_page
    for f in _decoding(io, requests, page + 1):
        rid = f.state.request_id
        block, offset = int(a.block_table[rid][0]), 1
        token_bytes = a.num_key_value_heads * a.head_dim * a.cache_dtype.itemsize
        a._copy_view[block, offset * token_bytes + 3] ^= 0x10       # layer 0's K row
        d.request_id, d.position, d.block = rid, offset, block
        d.detail = f"one byte of layer 0's K at {rid} position {offset} (block {block}) flipped"
        return True
    return False


def _position_shift(d, io, requests) -> bool:
    page = _allocator(io).tokens_per_page
    for f in _decoding(io, requests, 2):
        past = f.state.position_offset
        if (past + 1) % page not in (0, 1):     # the shifted write stays inside the block
            f.state.position_offset += 1
            d.request_id, d.position = f.state.request_id, past
            d.detail = f"position offset of {d.request_id} moved from {past} to {past + 1}"
            return True
    return False


_FIRE = {"remap": _remap, "free-held": _free_held, "kv-flip": _kv_flip,
         "position-shift": _position_shift}
