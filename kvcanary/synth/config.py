"""The options of a synthesis run (every field is a ``kvcanary synth`` option) and its counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..format.consts import RealKvHashMode
from ..format.errors import ToolError

MODES = ("none", "partial", "all")
# Seeds are recorded in int64 dump keys (synth_config) and feed numpy's SeedSequence.
MAX_SEED = (1 << 63) - 1
# Real-KV source ``i`` holds dtype ``SOURCE_DTYPES[i % 4]``, so runs cover several element sizes.
SOURCE_DTYPES = (np.uint8, np.float16, np.int32, np.float32)
# Seeds are recorded in int64 dump keys (synth_config) and feed numpy's SeedSequence.
MAX_SEED = (1 << 63) - 1


class SynthError(ToolError):
    """A bad synthesis option, or an honest run that produced a violation (a bug)."""


@dataclass
class SynthConfig:
    requests: int = 64
    num_slots: int = 4096
    max_running: int = 16
    page_size: int = 1
    swa_window: int = 0
    sources: int = 1
    bytes_per_token: int = 32
    mode: str = "all"
    chunk_size: int = 64
    prompt_len: tuple = (8, 96)
    output_len: tuple = (4, 32)
    shared_prefixes: int = 4
    shared_prefix_len: tuple = (16, 64)
    share_prob: float = 0.6
    followup_prob: float = 0.3
    vocab: int = 32000
    verify_every: int = 8
    seed: int = 0
    backend: str = "numpy"
    # > 0: a paged engine with blocks of this many slots (its pages), dumping a block table.
    block_size: int = 0

    def __post_init__(self):
        if self.block_size > 0 and self.page_size == 1:
            self.page_size = self.block_size

    @property
    def paged(self) -> bool:
        return self.block_size > 0

    def validate(self) -> None:
        def need(ok, message):
            if not ok:
                raise SynthError(message)

        need(self.requests >= 1, f"--requests must be at least 1, got {self.requests}")
        need(self.max_running >= 1, f"--max-running must be at least 1, got {self.max_running}")
        need(self.page_size >= 1, f"--page-size must be at least 1, got {self.page_size}")
        need(self.block_size >= 0, f"--block-size must be >= 0, got {self.block_size}")
        need(not self.paged or self.page_size == self.block_size,
             f"--block-size {self.block_size} is the paged engine's page size; --page-size "
             f"{self.page_size} contradicts it (leave it out)")
        need(self.swa_window >= 0, f"--swa-window must be >= 0, got {self.swa_window}")
        need(0 <= self.sources <= 64, f"--sources must be in [0, 64], got {self.sources}")
        need(self.bytes_per_token >= 16 and self.bytes_per_token % 16 == 0,
             f"--bytes-per-token must be a positive multiple of 16, got {self.bytes_per_token}")
        need(self.mode in MODES, f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        need(self.chunk_size >= 1, f"--chunk-size must be at least 1, got {self.chunk_size}")
        need(self.verify_every >= 0, f"--verify-every must be >= 0, got {self.verify_every}")
        need(0 <= self.seed <= MAX_SEED, f"--seed must be in [0, {MAX_SEED}], got {self.seed}")
        for name in ("prompt_len", "output_len", "shared_prefix_len"):
            low, high = getattr(self, name)
            need(1 <= low <= high, f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got "
                                   f"{low}..{high}")
        need(self.backend in ("numpy", "cupy"),
             f"--backend must be numpy or cupy, got {self.backend!r}")
        need(self.vocab >= 2, f"--vocab must be at least 2, got {self.vocab}")
        need(self.num_slots >= 2 * self.page_size,
             f"--slots must hold at least two pages, got {self.num_slots}")
        need(self.num_slots < 2 ** 31, f"--slots must be below 2**31 (int32 table), got "
                                       f"{self.num_slots}")
        least = self.max_context_len + 2 * self.page_size + self.block_tokens
        need(self.num_slots >= least,
             f"--slots {self.num_slots} cannot hold one request of up to {self.max_context_len} "
             f"tokens; use at least {least}")

    @property
    def block_tokens(self) -> int:
        """Tokens per prefix-cache block: one page, or 16 tokens when pages are single slots."""
        return self.page_size if self.page_size > 1 else 16

    @property
    def single_len(self) -> int:
        return self.shared_prefix_len[1] + self.prompt_len[1] + self.output_len[1]

    @property
    def max_context_len(self) -> int:
        """A follow-up request extends one earlier conversation once."""
        return 2 * self.single_len

    @property
    def hash_mode(self) -> RealKvHashMode:
        return RealKvHashMode[self.mode.upper()]

    def record(self) -> dict:
        """The options as the dump records them (a per-token run leaves block_size out)."""
        values = asdict(self)
        if not self.paged:
            del values["block_size"]
        return values


@dataclass
class Stats:
    steps: int = 0
    tokens_written: int = 0
    cached_tokens_reused: int = 0
    blocks_folded: int = 0
    blocks_evicted: int = 0
    slots_reused: int = 0
    verify_launches: int = 0
    entries_verified: int = 0
    elapsed_s: float = 0.0
