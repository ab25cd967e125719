"""The engine's index and input tensors as the guard reads them every step: physical row
indices turned into canary slots, and the engine's static CPU buffers read as numpy views.

Continuous batching names a token's K row of one layer by a physical row index of its cache
tensor (``block * block_physical_stride + offset``); kvcanary names it by its canary slot
(``block * page_size + offset``). :class:`SlotTable` converts through a table built once
(integer division was most of the conversion's cost), or by the arithmetic for a cache too
large for the table. :class:`HostViews` keeps a numpy view of each of the engine's CPU
tensors while the engine keeps the same tensor over the same memory (it fills its buffers in
place), so a step slices an array instead of converting a tensor again.
"""

from __future__ import annotations

import numpy as np

# Physical row indices a slot table covers (8 bytes each: at most 16 MiB; a cache row is at
# least 16 bytes of KV, so the table is at most half the cache, usually a few percent).
MAX_SLOT_TABLE = 1 << 21


class SlotTable:
    """Canary slots of one cache group's physical row indices: ``stride`` rows per block,
    the first ``page`` of them the group's K rows of the first layer, ``num_blocks``
    blocks."""

    def __init__(self, stride: int, page: int, num_blocks: int):
        self.stride, self.page, self.num_blocks = stride, page, num_blocks
        self.num_slots = num_blocks * page
        self.table = None       # built on the first conversion; False: too large

    def to_slots(self, physical: np.ndarray) -> np.ndarray:
        """The slot of each index; ``num_slots`` (outside the buffer) where an index names no
        K row of a block."""
        physical = np.asarray(physical, dtype=np.int64)
        table = self._table()
        if table is not None:
            # A negative index is, as unsigned, past the table: its last entry, num_slots.
            return table.take(np.minimum(physical.view(np.uint64), table.size - 1)
                              .view(np.int64))
        block = physical // self.stride
        offset = physical - block * self.stride
        slots = block * self.page + offset
        bad = (block.view(np.uint64) >= self.num_blocks) | (offset >= self.page)
        slots[bad] = self.num_slots
        return slots

    def _table(self) -> np.ndarray | None:
        """The slot of every physical row index, one more entry (``num_slots``) for any index
        outside them; None where it would exceed ``MAX_SLOT_TABLE`` entries."""
        if self.table is None:
            rows = self.num_blocks * self.stride
            if rows > MAX_SLOT_TABLE or self.stride < self.page:    # (the engine's is not)
                self.table = False
            else:
                table = np.full(rows + 1, self.num_slots, dtype=np.int64)
                by_block = table[:rows].reshape(self.num_blocks, self.stride)
                by_block[:, :self.page] = np.arange(self.num_slots,
                                                    dtype=np.int64).reshape(-1, self.page)
                self.table = table
        return self.table if self.table is not False else None


class HostViews:
    """The engine's tensors as numpy arrays: on the CPU (``on_host``) a view kept between
    steps while the engine keeps the same tensor over the same memory, elsewhere a fresh
    copy to the host each time."""

    KEPT = 16       # views kept before starting over (the engine made new tensors)

    def __init__(self, on_host: bool):
        self.on_host = on_host
        self.kept: dict = {}    # id(tensor) -> (tensor, data pointer, shape, numpy view)

    def of(self, tensor) -> np.ndarray:
        if not self.on_host:
            return host_array(tensor)
        kept = self.kept.get(id(tensor))
        # A tensor resized in place may keep its pointer: the view must keep its shape too.
        if kept is None or kept[0] is not tensor or kept[1] != tensor.data_ptr() \
                or kept[2] != tensor.shape:
            if len(self.kept) >= self.KEPT:
                self.kept.clear()
            kept = self.kept[id(tensor)] = (tensor, tensor.data_ptr(), tensor.shape,
                                            host_array(tensor))
        return kept[3]


def host_array(tensor) -> np.ndarray:
    """A torch tensor as a numpy array (a view on the CPU)."""
    return tensor.detach().cpu().numpy()


def batching_ios():
    """transformers' synchronous batching inputs class (imported once, on the first step:
    an import statement costs microseconds every step)."""
    global _BATCHING_IOS
    if _BATCHING_IOS is None:
        from transformers.generation.continuous_batching.input_outputs import (
            ContinuousBatchingIOs,
        )

        _BATCHING_IOS = ContinuousBatchingIOs
    return _BATCHING_IOS


_BATCHING_IOS = None
