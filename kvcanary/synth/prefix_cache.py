"""The radix-style prefix cache, at block granularity (``config.block_tokens`` tokens a block).

A block's key is its parent block and its tokens, so a lookup walks the longest cached prefix
of a prompt. A request that matched blocks holds a reference on each; a finished request
inserts its full blocks (a block already cached is folded: the request's copy is freed) and
frees the rest of its slots. Unreferenced leaf blocks are evicted least recently used when the
allocator runs short.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .allocator import SlotAllocator
from .config import Stats


@dataclass(eq=False)
class CachedBlock:
    key: tuple
    id: int
    parent: "CachedBlock | None"
    depth: int
    slots: np.ndarray
    refs: int = 0
    children: int = 0
    last_used: int = 0


class PrefixCache:
    def __init__(self, block_tokens: int, allocator: SlotAllocator, stats: Stats,
                 swa_window: int = 0):
        self.block_tokens = block_tokens
        self.allocator = allocator
        self.stats = stats
        self.swa_window = swa_window
        self.blocks: dict = {}
        self.next_block_id = 1

    def __len__(self) -> int:
        return len(self.blocks)

    def values(self):
        return self.blocks.values()

    def match(self, tokens: np.ndarray, limit: int) -> list:
        """Cached blocks covering the longest prefix of ``tokens[:limit]``."""
        B, blocks, parent = self.block_tokens, [], 0
        for k in range(limit // B):
            block = self.blocks.get((parent, tokens[k * B:(k + 1) * B].tobytes()))
            if block is None:
                break
            blocks.append(block)
            parent = block.id
        if self.swa_window and blocks:
            # Only a prefix whose last window is still SWA-resident can be reused.
            W, lut = self.swa_window, self.allocator.lut
            while blocks:
                slots = np.concatenate([b.slots for b in blocks])
                if (lut[slots[max(0, slots.size - W):]] != 0).all():
                    break
                blocks.pop()
        return blocks

    def acquire(self, blocks: list, step: int) -> None:
        for block in blocks:
            block.refs += 1
            block.last_used = step

    def insert(self, tokens: np.ndarray, seq_len: int, matched_blocks: list,
               row_slots: np.ndarray, step: int) -> None:
        """A finished request's turn: release its matched blocks, cache its full blocks, free
        everything else it owns (``row_slots``: its full slots by position)."""
        B = self.block_tokens
        parent = matched_blocks[-1] if matched_blocks else None
        for block in matched_blocks:
            block.refs -= 1
            block.last_used = step
        full = seq_len // B
        for k in range(len(matched_blocks), full):
            key = (parent.id if parent else 0, tokens[k * B:(k + 1) * B].tobytes())
            slots = row_slots[k * B:(k + 1) * B]
            block = self.blocks.get(key)
            if block is None:
                block = CachedBlock(key=key, id=self.next_block_id, parent=parent, depth=k,
                                    slots=slots.copy(), last_used=step)
                self.next_block_id += 1
                self.blocks[key] = block
                if parent is not None:
                    parent.children += 1
            else:
                self.allocator.free_slots(slots)
                self.stats.blocks_folded += 1
                block.last_used = step
            parent = block
        self.allocator.free_slots(row_slots[full * B:seq_len])

    def subtree(self, block: CachedBlock) -> list:
        """``block`` and every cached block below it, in cache order."""
        def below(b):
            while b is not None:
                if b is block:
                    return True
                b = b.parent
            return False

        return [b for b in self.blocks.values() if below(b)]

    def drop_subtree(self, block: CachedBlock) -> None:
        """Forget ``block`` and every cached block below it (their slots are not freed: the
        caller decides what happens to them)."""
        for b in self.subtree(block):
            del self.blocks[b.key]
        if block.parent is not None:
            block.parent.children -= 1

    def evict(self, pages_needed: int) -> bool:
        """Evict unreferenced leaf blocks, least recently used first, until the unreserved free
        pages cover ``pages_needed`` plus a small reserve; False if they cannot."""
        allocator = self.allocator
        target = pages_needed + max(1, allocator.num_pages // 32)
        while allocator.unreserved_pages < target:
            leaves = [b for b in self.blocks.values() if b.refs == 0 and b.children == 0]
            if not leaves:
                return allocator.unreserved_pages >= pages_needed
            leaves.sort(key=lambda b: (b.last_used, b.id))
            for block in leaves:
                del self.blocks[block.key]
                if block.parent is not None:
                    block.parent.children -= 1
                allocator.free_slots(block.slots)
                self.stats.blocks_evicted += 1
                if allocator.unreserved_pages >= target:
                    break
        return True


class SweepIndex:
    """The cache's blocks as sweep entries, in the dump's order (canary slots: SWA slots under
    a window); a block's first entry links to its parent's last. ``unmapped`` marks the
    entries of blocks no live request holds."""

    def __init__(self, cache: PrefixCache, lut):
        B = cache.block_tokens
        self.block_tokens = B
        self.blocks = list(cache.values())
        slots, prevs, positions, unmapped = [], [], [], []
        for block in self.blocks:
            own = block.slots.astype(np.int64)
            prev = np.empty_like(own)
            prev[0] = block.parent.slots[-1] if block.parent is not None else -1
            prev[1:] = own[:-1]
            slots.append(own)
            prevs.append(prev)
            positions.append(block.depth * B + np.arange(B, dtype=np.int64))
            unmapped.append(np.full(B, block.refs == 0))
        empty = np.zeros(0, dtype=np.int64)
        self.slots = np.concatenate(slots) if slots else empty
        self.prevs = np.concatenate(prevs) if prevs else empty
        self.positions = np.concatenate(positions) if positions else empty
        self.unmapped = np.concatenate(unmapped) if unmapped else np.zeros(0, dtype=bool)
        if lut is not None:
            self.slots = lut[self.slots]
            self.prevs = np.where(self.prevs >= 0, lut[np.maximum(self.prevs, 0)], self.prevs)

    def owner(self, k: int) -> tuple:
        """``(block, index in block)`` of sweep entry ``k``."""
        return self.blocks[k // self.block_tokens], k % self.block_tokens
