"""Cache groups: kvcanary's records per attention type of a transformers model.

Continuous batching keeps one allocator per attention type, a *cache group*: the model's
full-attention layers and its sliding-window layers each get their own blocks, block tables
and rows of the step's read and write indices, inside one cache tensor. kvcanary follows
that: one :class:`~.session.Session` per group, with the group's own canary buffer, slots
(``block * page_size + offset`` of the group's blocks), real-KV sources (the group's layers)
and findings. :class:`CacheSession` runs them side by side, step by step.

A full-attention group verifies every cached position. A sliding-window group of window
``W`` (:class:`_SlidingSession`) keeps a ring of ``ceil(W / page_size)`` blocks per
request: position ``p`` lives in ring slot ``p % W``, so a new token overwrites the one that
slid out of the window. Attention gathers the ``W - 1`` positions before the step's new
tokens, and exactly those are verified: kvcanary's plan with ``swa_window_size = W - 1``.
As with SGLang's sliding-window pool, a position that slid out counts as freed: the table
maps it to slot 0 (through the identity full-to-SWA table of the group's own slots), so the
window head's chain link is not checked against a slot that is legitimately being reused.
Whatever lands in a slot after its position slid out is no finding; a slot of a position
still inside a window that changes (another request's write, a byte flip, a remap) is.
A prefill chunk longer than the window keeps only its last ``W`` tokens; the engine writes
the others to its trash, where kvcanary expects them (slot 0 as well).

:func:`check_model` refuses at ``guard()`` what this does not cover.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ... import LaunchTag
from ...model.types import to_host
from ...format.errors import GuardError
from .session import Session
from .stepbatch import BlockTables

if TYPE_CHECKING:    # the guard module imports this one
    from . import Guard

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def check_model(config) -> dict:
    """The cache groups continuous batching builds for a model's text ``config``
    (attention type -> layer indices). Raises :class:`GuardError` for a model kvcanary
    cannot guard: a layer type other than full or sliding-window attention, or a sliding
    window that is not an integer of at least 2 tokens."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = {}
        for layer, kind in enumerate(layer_types):
            if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
                other.setdefault(kind, []).append(layer)
        if other:
            listed = "; ".join(f"{kind!r} (layers {', '.join(map(str, layers))})"
                               for kind, layers in other.items())
            raise GuardError(f"layer_types has {listed}; kvcanary guards "
                             f"'{FULL_ATTENTION}' and '{SLIDING_ATTENTION}' layers only")
    groups = group_layers_by_attn_type(config)
    if SLIDING_ATTENTION in groups:
        window = getattr(config, "sliding_window", None)
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise GuardError(
                f"sliding_window={window!r} for the sliding-window layers "
                f"{groups[SLIDING_ATTENTION]}: kvcanary guards windows of at least 2 tokens "
                "(a window of 1 reads no cached KV)")
    return groups


class _SlidingSession(Session):
    """One sliding-window cache group: the ring of blocks per request, the window verified
    (the ``W - 1`` cached positions attention gathers), slid-out positions and a long
    chunk's trashed tokens mapped to slot 0."""

    launch_tag = LaunchTag.TAIL_K_SWA

    def __init__(self, g: "Guard", cache, group_name: str, allocator):
        super().__init__(g, cache, group_name, allocator)
        self.window = int(allocator.sliding_window)
        self.swa_window_size = self.window - 1
        # The group's slots are its own: the full-to-SWA table is the identity, one entry
        # longer so that the out-of-buffer marker (num_slots) reaches verify as itself.
        self.lut = self.xp.arange(self.num_slots + 1, dtype=self.xp.int64)

    def step_tables(self, blocks: BlockTables, past: np.ndarray, query: np.ndarray,
                    width: int) -> np.ndarray:
        """The ring slot of each position (``num_slots`` past the blocks), 0 for positions
        that slid out of the window and for a long chunk's trashed tokens."""
        ring = np.arange(width, dtype=np.int64) % self.window
        slots = blocks.grid(ring // self.page, ring % self.page, self.page, self.num_slots)
        columns = np.arange(width)[None, :]
        slots[columns < (past - self.swa_window_size)[:, None]] = 0      # slid out
        slots[(columns >= past[:, None])
              & (columns < (past + query - self.window)[:, None])] = 0   # a long chunk's trash
        return slots

    def read_span(self, engine_past: np.ndarray, query: np.ndarray) -> tuple:
        cached = np.minimum(engine_past, self.swa_window_size)
        return cached + query, engine_past - cached     # then one sentinel per new token

    def written_slots(self, io, batch, planned: np.ndarray) -> np.ndarray:
        if io.use_block_table:
            return super().written_slots(io, batch, planned)
        physical = self.host_view(io.write_index_storage)[self.group_index, :planned.size]
        written = self.to_slots(physical)
        written[(planned == 0) & (physical == self.allocator.write_trash_index)] = 0
        return written

    def dump_table(self, last) -> dict:
        """A per-token table of each request's window (0 before it), with the window size
        and the full-to-SWA table, so the audit checks the same entries."""
        width = max(1, max(length for _, _, length, _ in last))
        table = np.zeros((len(last) + 1, width), dtype=np.int64)
        for i, (_, blocks, length, _) in enumerate(last):
            slots = _ring_slots(np.asarray(blocks, dtype=np.int64), length, self.window,
                                self.page, self.num_slots)
            slots[:max(0, length - self.swa_window_size)] = 0
            table[i + 1, :length] = slots
        return dict(req_to_token=table, swa_window_size=self.swa_window_size,
                    full_to_swa_index_mapping=np.ascontiguousarray(to_host(self.lut)))


def _ring_slots(blocks: np.ndarray, length: int, window: int, page: int,
                missing: int) -> np.ndarray:
    """Slot of each position ``[0, length)`` in a ring of ``blocks``: position ``p`` in ring
    slot ``p % window``; ``missing`` where the ring has no block yet."""
    ring = np.arange(length, dtype=np.int64) % window
    index = ring // page
    inside = index < blocks.size
    slots = np.full(length, missing, dtype=np.int64)
    slots[inside] = blocks[index[inside]] * page + ring[inside] % page
    return slots


class CacheSession:
    """kvcanary's state beside one PagedAttentionCache: a session per cache group
    (``groups``, in the engine's order), run together around each forward step."""

    def __init__(self, g: "Guard", cache):
        from transformers.generation.continuous_batching.cache_allocators import (
            FullAttentionCacheAllocator,
            SlidingAttentionCacheAllocator,
        )

        kinds = {FullAttentionCacheAllocator: Session, SlidingAttentionCacheAllocator:
                 _SlidingSession}
        self.guard, self.cache = g, cache
        allocators = cache.cache_allocators
        self.groups = []
        for name, allocator in allocators.items():
            kind = kinds.get(type(allocator))
            if kind is None:      # check_model refuses such a model at guard()
                raise GuardError(f"cache group {name!r} ({type(allocator).__name__}) "
                                 "is not supported")
            session = kind(g, cache, name, allocator)
            if len(allocators) > 1:
                session.explanation_prefix = f"{name} group: "
            self.groups.append(session)
        self.entries = dict.fromkeys(allocators, 0)    # entries verified per group

    @property
    def xp(self):
        return self.groups[0].xp

    @property
    def last(self):
        return self.groups[0].last

    def group(self, name: str | None) -> Session:
        """The session of cache group ``name`` (None: the first, the engine's order)."""
        if name is None:
            return self.groups[0]
        for session in self.groups:
            if session.group_name == name:
                return session
        raise GuardError(f"no cache group {name!r}; this model has "
                         f"{', '.join(s.group_name for s in self.groups)}")

    def on_engine_stream(self, processor):
        return self.groups[0].on_engine_stream(processor)

    def before_step(self, processor) -> None:
        stats = self.guard.stats
        stats["steps"] += 1
        for session in self.groups:
            before = stats["entries_verified"]
            try:
                session.before_step(processor)
            finally:
                self.entries[session.group_name] += stats["entries_verified"] - before

    def after_step(self, processor) -> None:
        for session in self.groups:
            session.after_step(processor)

    def describe(self) -> list:
        """Per group: name, layers, window (None for full attention), real-KV sources and
        entries verified."""
        return [dict(name=s.group_name, layers=list(s.allocator.layer_indices),
                     window=getattr(s, "window", None),
                     sources=[name for name, _ in s.real_kv],
                     entries_verified=self.entries[s.group_name]) for s in self.groups]

    def dump_arrays(self, group: str | None = None) -> dict:
        return self.group(group).dump_arrays()
