"""The guard under transformers' long-running manager (``model.init_continuous_batching()``,
``add_request``, ``request_id_iter`` / ``get_result``, ``cancel_request``, ``stop``), which
serves an unbounded stream of requests on its own thread.

The guard's step hooks run on the manager's thread, so findings arrive while it runs (the
``kvcanary`` logger or the callable, called on that thread). What this module adds, through
two more hooks installed and restored with the others:

* ``ContinuousBatchProcessor.update_batch``: after each step's update, what the session
  keeps per request is dropped for every request the scheduler no longer holds (finished,
  failed, cancelled in flight or while queued); the table of request names behind the
  per-slot writer column is compacted once it outgrows the live requests, so memory is bounded
  by the cache and the requests in flight, not by the requests served. Requests marked with
  :func:`abort_request` are failed there: the scheduler frees them and their client gets an
  output whose ``error`` names the finding.
* ``OutputRouter.deliver_batch``: an output of a request marked for abort, delivered by the
  step that found the problem, carries the error instead of passing as a success.

A guard also keeps at most :data:`STEP_TIMES_KEPT` step timings and :data:`RAW_ROWS_KEPT` raw
ring rows (the newest).
"""

from __future__ import annotations

import threading

import numpy as np

from ...format.errors import GuardError
from .hooks import Hooks

STEP_TIMES_KEPT = 100_000
RAW_ROWS_KEPT = 100_000
# The names table is compacted when it holds this many more names than are still referenced.
_NAMES_SLACK = 4096

_delivering = threading.local()     # the guard whose update is delivering outputs


def hook_targets() -> tuple:
    """The (owner, attribute, hook) triples this module adds to the guard's hooks."""
    from transformers.generation.continuous_batching import continuous_api as api

    return ((api.ContinuousBatchProcessor, "update_batch", _update_batch_hook),
            (api.OutputRouter, "deliver_batch", _deliver_batch_hook))


Hooks.more_targets.append(hook_targets)


def abort_request(guard, request_id: str, reason: str) -> None:
    """Fail ``request_id`` (and, for a fork's parent, nothing else) at the end of the current
    step: its client gets an output with ``error`` set to ``reason`` and the engine frees it.
    Safe to call from the guard's callable (on the manager's thread)."""
    with _lock_of(guard):
        guard.__dict__.setdefault("_aborts", {})[request_id] = reason


def abort_all(guard, reason: str) -> None:
    """Fail every request the guarded engine holds, at the end of the current step."""
    with _lock_of(guard):
        guard.__dict__["_abort_all"] = reason


def _lock_of(guard) -> threading.Lock:
    return guard.__dict__.setdefault("_abort_lock", threading.Lock())


def _pending(guard) -> tuple:
    with _lock_of(guard):
        return dict(guard.__dict__.get("_aborts", {})), guard.__dict__.get("_abort_all")


def _update_batch_hook(original):
    def update_batch(self):
        sessions = Hooks.sessions_of(lambda s: s.cache is self.cache)
        if not sessions:
            return original(self)
        g = sessions[0].guard
        _delivering.guard = g
        try:
            original(self)
        finally:
            _delivering.guard = None
        _apply_aborts(g, self)
        for session in sessions:    # one per cache group
            prune(session, self.scheduler)

    update_batch.__wrapped__ = original
    return update_batch


def _deliver_batch_hook(original):
    def deliver_batch(self, outputs):
        g = getattr(_delivering, "guard", None)
        if g is not None:
            aborts, everything = _pending(g)
            if aborts or everything:
                for output in outputs:
                    reason = everything or aborts.get(output.request_id)
                    if reason is not None and output.error is None:
                        _fail_output(output, reason)
        return original(self, outputs)

    deliver_batch.__wrapped__ = original
    return deliver_batch


def _fail_output(output, reason: str) -> None:
    from transformers.generation.continuous_batching.requests import RequestStatus

    output.status = RequestStatus.FAILED
    output.error = reason


def _apply_aborts(g, processor) -> None:
    aborts, everything = _pending(g)
    if not aborts and not everything:
        return
    scheduler = processor.scheduler
    if everything:
        aborts = dict.fromkeys(list(scheduler.active_requests) + list(scheduler.waiting_requests),
                               everything)
    for request_id, reason in aborts.items():
        state = scheduler.active_requests.get(request_id)
        if state is None:
            state = scheduler.waiting_requests.pop(request_id, None)
            if state is not None and request_id in scheduler.waiting_requests_order:
                scheduler.waiting_requests_order.remove(request_id)
        if state is not None:
            processor._handle_request_error(GuardError(reason), state)
            scheduler.finish_request(request_id)
    with _lock_of(g):
        for request_id in aborts:
            g.__dict__.get("_aborts", {}).pop(request_id, None)


def prune(session, scheduler) -> int:
    """Drop what ``session`` keeps for requests ``scheduler`` no longer holds; compact the
    names table when it holds :data:`_NAMES_SLACK` names more than are referenced. Returns how
    many requests were dropped."""
    active, waiting = scheduler.active_requests.keys(), scheduler.waiting_requests.keys()
    gone = session.requests.keys() - active - waiting      # set operations, in C
    live = active | waiting if session.saved else ()
    stats = session.guard.stats
    stats["requests_guarded"] = stats.get("requests_guarded", 0) + len(gone)
    for rid in gone:
        del session.requests[rid]
        session.uid_of.pop(rid, None)
    for rid in [rid for rid in session.saved if rid not in live]:
        del session.saved[rid]
    if len(session.request_names) > len(session.uid_of) + session.num_slots + _NAMES_SLACK:
        _compact_names(session)
    return len(gone)


def _compact_names(session) -> None:
    """Renumber the request names still referenced (by a slot's writer or a live request)."""
    column = session.writer_request
    used = np.zeros(len(session.request_names) + 1, dtype=bool)
    used[column[column >= 0]] = True
    used[list(session.uid_of.values())] = True
    used[-1] = False
    old = np.flatnonzero(used)
    new_of_old = np.full(used.size, -1, dtype=np.int64)
    new_of_old[old] = np.arange(old.size)
    column[column >= 0] = new_of_old[column[column >= 0]]
    session.request_names = [session.request_names[i] for i in old.tolist()]
    session.uid_of = {rid: int(new_of_old[uid]) for rid, uid in session.uid_of.items()}
    for rid, rec in session.requests.items():    # each live record keeps its row
        rec.uid = session.uid_of[rid]
