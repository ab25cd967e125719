"""Where kvcanary hooks into transformers' continuous batching, and how it leaves again.

While at least one guard is active, five engine methods are wrapped (each wrapper keeps the
original as ``__wrapped__`` and hands the call to the session of the guarded model):

* ``ContinuousBatchProcessor._generation_step``: plan and verify before the forward, the
  write after it;
* ``CacheAllocator.copy_blocks`` (forks): records are copied with the KV blocks;
* ``CacheAllocator.fork_blocks``: which blocks a fork child shares with its parent, for the
  allocator's history (a shared block is a fork's share, not a prefix hit);
* ``OffloadingManager._offload_to_cpu`` and ``restore_scheduled_requests``: records leave
  and come back with the KV;
* those registered in ``Hooks.more_targets``: the two of :mod:`.manager` (a long-running
  manager's finished requests are dropped, and requests are aborted on a finding).

On the last guard's exit every attribute is restored exactly (one a class did not define
itself is deleted again). transformers is imported only inside the functions here.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import TYPE_CHECKING

from ...format.errors import GuardError

if TYPE_CHECKING:    # the guard module imports this one
    from . import Guard

# Versions whose continuous batching has the hook points and layout used here.
SUPPORTED_VERSIONS = ((5, 20), (5, 24))   # first and last supported minor, inclusive
SUPPORTED_RANGE = ">=5.20,<5.25"


_logger = logging.getLogger("kvcanary")


def supported_version(version: str) -> bool:
    """Whether ``version`` (a transformers ``__version__``) lies in ``SUPPORTED_RANGE``: a
    release (``5.22.2``, also with a post-release or local tag) of a supported minor; a
    pre-release or development build (``5.20.0rc1``, ``5.25.0.dev0``) is outside it."""
    match = _RELEASE.fullmatch(version.strip())
    if match is None:
        return False
    return SUPPORTED_VERSIONS[0] <= (int(match[1]), int(match[2])) <= SUPPORTED_VERSIONS[1]


_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.\d+)?(?:\.post\d+)?(?:\+[0-9A-Za-z.]+)?")


class Hooks:
    """The class attributes kvcanary replaces while at least one guard is active, restored
    exactly (an attribute a class did not define itself is deleted again)."""

    lock = threading.Lock()
    active: dict = {}      # id(model) -> Guard
    saved: list = []       # (owner, name, had_own, original)
    # Functions returning more (owner, name, hook) triples: other modules register theirs.
    more_targets: list = []

    @classmethod
    def targets(cls):
        from transformers.generation.continuous_batching import cache_allocators as ca
        from transformers.generation.continuous_batching import continuous_api as api
        from transformers.generation.continuous_batching import offloading_manager as om

        extra = tuple(target for more in cls.more_targets for target in more())
        return extra + (
            (api.ContinuousBatchProcessor, "_generation_step", _generation_step_hook),
            (ca.CacheAllocator, "copy_blocks", _copy_blocks_hook),
            (ca.CacheAllocator, "fork_blocks", _fork_blocks_hook),
            (om.OffloadingManager, "_offload_to_cpu", _offload_hook),
            (om.OffloadingManager, "restore_scheduled_requests", _restore_hook),
        )

    @classmethod
    def add(cls, g: "Guard") -> None:
        with cls.lock:
            if id(g.model) in cls.active:
                raise GuardError("this model is already guarded (one guard per model "
                                 "at a time)")
            if not cls.active:
                targets = cls.targets()
                for owner, name, _ in targets:
                    if not callable(getattr(owner, name, None)):
                        raise GuardError(f"transformers lacks {owner.__name__}.{name}; "
                                         f"supported: transformers{SUPPORTED_RANGE}")
                for owner, name, hook in targets:
                    original = getattr(owner, name)
                    cls.saved.append((owner, name, name in owner.__dict__,
                                      owner.__dict__.get(name)))
                    setattr(owner, name, hook(original))
            cls.active[id(g.model)] = g

    @classmethod
    def remove(cls, g: "Guard") -> None:
        with cls.lock:
            cls.active.pop(id(g.model), None)
            if cls.active:
                return
            while cls.saved:
                owner, name, had_own, original = cls.saved.pop()
                if had_own:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)

    @classmethod
    def sessions_of(cls, match) -> list:
        """The cache-group sessions of every active guard that ``match`` accepts."""
        return [s for g in list(cls.active.values()) if g.session is not None
                for s in g.session.groups if match(s)]


def _generation_step_hook(original):
    def _generation_step(self, model):
        g = Hooks.active.get(id(model))
        if g is None or g.error is not None:
            return original(self, model)
        start = time.perf_counter()
        try:
            session = g.session_for(self)
            with session.on_engine_stream(self):
                session.before_step(self)
        except Exception as exc:   # a bug in the guard must not fail the engine's requests
            _step_aside(g, exc, "before")
            return original(self, model)
        forward = time.perf_counter()
        result = original(self, model)
        back = time.perf_counter()
        try:
            with session.on_engine_stream(self):
                session.after_step(self)
        except Exception as exc:
            _step_aside(g, exc, "after")
            return result
        g.time_step(forward - start + time.perf_counter() - back, back - forward)
        return result

    _generation_step.__wrapped__ = original
    return _generation_step


def _step_aside(g, exc: Exception, when: str) -> None:
    """The guard failed: log it loudly, stop guarding this call (``g.error`` set: the
    remaining steps run unguarded) and let ``generate_batch`` raise it."""
    text = f"the guard failed {when} an engine step ({type(exc).__name__}: {exc}); " \
        "the rest of this generate_batch ran unguarded"
    error = GuardError(text)
    _logger.error("%s", error)
    if g.error is None:
        error.__cause__ = exc
        g.error = error


def _copy_blocks_hook(original):
    def copy_blocks(self, source_block_ids, dest_block_ids):
        original(self, source_block_ids, dest_block_ids)
        for session in Hooks.sessions_of(lambda s: s.allocator is self):
            with session.on_engine_stream():
                session.copy_records(list(source_block_ids), list(dest_block_ids))

    copy_blocks.__wrapped__ = original
    return copy_blocks


def _fork_blocks_hook(original):
    def fork_blocks(self, source_request_id, dest_request_id, past_length):
        copies = original(self, source_request_id, dest_request_id, past_length)
        for session in Hooks.sessions_of(lambda s: s.allocator is self):
            session.history.note_fork(source_request_id, dest_request_id, len(copies[1]),
                                      session.step)
        return copies

    fork_blocks.__wrapped__ = original
    return fork_blocks


def _offload_hook(original):
    def _offload_to_cpu(self, victims, victim_block_tables):
        offloaded = original(self, victims, victim_block_tables)
        for session in Hooks.sessions_of(lambda s: s.cache is self.cache):
            with session.on_engine_stream():
                for request_id in offloaded:
                    blocks = victim_block_tables[request_id].get(session.group_name, [])
                    session.save_records(request_id, blocks)
        return offloaded

    _offload_to_cpu.__wrapped__ = original
    return _offload_to_cpu


def _restore_hook(original):
    def restore_scheduled_requests(self, requests_in_batch):
        for session in Hooks.sessions_of(lambda s: s.cache is self.cache):
            with session.on_engine_stream():
                for future in requests_in_batch:
                    if future.state.is_cpu_offloaded:
                        session.restore_records(future.state)
        return original(self, requests_in_batch)

    restore_scheduled_requests.__wrapped__ = original
    return restore_scheduled_requests
