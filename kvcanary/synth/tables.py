"""The request-to-slot tables an engine keeps: SGLang's per-token ``req_to_token``, or a
vLLM-style block table (one block id per ``block_size`` positions; block 0 is the null
block). The scheduler, fault injection and the dump writer go through the same interface,
so the paged engine never builds a per-token table."""

from __future__ import annotations

import numpy as np


class TokenTable:
    """``req_to_token [rows, max_len]``: the slot of every (row, position)."""

    block_size = 1
    key = "req_to_token"

    def __init__(self, rows: int, max_len: int):
        self.array = np.zeros((rows, max_len), dtype=np.int32)

    def map(self, row: int, start: int, slots: np.ndarray) -> None:
        """Map positions ``[start, start + len(slots))`` of ``row`` to ``slots``."""
        self.array[row, start:start + slots.shape[0]] = slots

    def slots(self, row: int, start: int, stop: int) -> np.ndarray:
        """The full slots of positions ``[start, stop)`` of ``row``, int64."""
        return self.array[row, start:stop].astype(np.int64)

    def plan_keywords(self) -> dict:
        return {"req_to_token": self.array}

    def dump_keys(self) -> dict:
        return {"req_to_token": self.array}


class BlockTable:
    """``block_table [rows, max_blocks]``: the block of every (row, block index); position
    ``p`` is slot ``block_table[row, p // block_size] * block_size + p % block_size``. Slots
    are mapped a block at a time (an engine hands out whole blocks)."""

    key = "block_table"

    def __init__(self, rows: int, max_len: int, block_size: int):
        self.block_size = block_size
        self.array = np.zeros((rows, -(-max_len // block_size)), dtype=np.int32)

    def map(self, row: int, start: int, slots: np.ndarray) -> None:
        positions = np.arange(start, start + slots.shape[0])
        self.array[row, positions // self.block_size] = slots // self.block_size

    def slots(self, row: int, start: int, stop: int) -> np.ndarray:
        positions = np.arange(start, stop, dtype=np.int64)
        blocks = self.array[row, positions // self.block_size].astype(np.int64)
        return blocks * self.block_size + positions % self.block_size

    def plan_keywords(self) -> dict:
        return {"block_table": self.array, "block_size": self.block_size}

    def dump_keys(self) -> dict:
        return {"block_table": self.array,
                "block_size": np.array(self.block_size, dtype=np.int64)}
