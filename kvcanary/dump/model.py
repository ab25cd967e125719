"""The dump format's catalogue: its version, the keys it defines (and the prefixes left to
writers), the int64 keys widened on save and load, and :class:`Dump`, a validated dump."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import numpy as np

from ..format.consts import LaunchTag, RealKvHashMode
from ..format.errors import ToolError


DUMP_VERSION = 1
# Batch rows scanned at a time (the live requests, the checks of the batch arrays): bounds the
# temporaries of a scan, whatever the batch size.
SCAN_ROWS = 1 << 20
VERSION_KEY = "kvcanary_dump_version"
STRING_KEYS = ("launch_tag", "real_kv_hash_mode")


class DumpError(ToolError):
    """A dump that cannot be read or does not follow format v1. The message names the file
    and the key at fault."""


@dataclass(eq=False)
class Dump:
    """A validated dump. Arrays are numpy (memory-mapped and read-only where the container
    allows); ``canary`` is always the ``uint8 [num_slots, stride]`` view."""

    path: str
    flavour: str
    canary: np.ndarray
    req_to_token: np.ndarray | None   # None in a paged dump, which holds block_table instead
    req_pool_indices: np.ndarray
    seq_lens: np.ndarray
    launch_tag: LaunchTag = LaunchTag.TAIL_K_FULL
    block_table: np.ndarray | None = None
    block_size: int = 1
    real_kv: tuple = ()
    real_kv_params: np.ndarray | None = None
    real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE
    swa_window_size: int = 0
    full_to_swa_index_mapping: np.ndarray | None = None
    expected_tokens: np.ndarray | None = None
    expected_tokens_valid_lens: np.ndarray | None = None
    sweep_slot_indices: np.ndarray | None = None
    sweep_prev_slot_indices: np.ndarray | None = None
    sweep_positions: np.ndarray | None = None
    extra: dict = field(default_factory=dict)
    # key -> the (begin, end) rows of a sparse file's array that hold data; the others lie in
    # the file's holes and read as zero (keys not here: every row). See ``row_ranges``.
    present_rows: dict = field(default_factory=dict)

    def row_ranges(self, key: str, rows: int = SCAN_ROWS):
        """``(begin, end)`` ranges of at most ``rows`` rows covering every row of ``key``'s
        array that can hold a value other than zero: all of them, except in a sparse file of
        a directory dump, whose holes (zeros) are never read. A scan over these ranges costs
        what the file holds, not what its header declares."""
        length = int(getattr(self, key).shape[0])
        for begin, end in self.present_rows.get(key, ((0, length),)):
            for first in range(begin, min(end, length), rows):
                yield first, min(end, length, first + rows)

    def live_batch(self) -> np.ndarray:
        """The batch indices whose ``req_pool_indices`` is not the padding row 0 (int64,
        ascending), scanned a slice of the batch at a time over the rows holding data (a
        scan per call: keep the result while the arrays do not change)."""
        parts = [np.flatnonzero(np.asarray(self.req_pool_indices[begin:end]) != 0) + begin
                 for begin, end in self.row_ranges("req_pool_indices")]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    @property
    def num_slots(self) -> int:
        return int(self.canary.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def slot_table(self) -> np.ndarray:
        """The table the dump holds: ``req_to_token``, or ``block_table`` in a paged dump."""
        return self.req_to_token if self.block_table is None else self.block_table

    @property
    def table_positions(self) -> int:
        """Positions a row of the slot table covers (0 for a table without rows: its width
        is a claim no entry backs)."""
        if self.slot_table.shape[0] == 0:
            return 0
        return int(self.slot_table.shape[1]) * self.block_size

    def plan_table(self, convert=lambda array: array) -> dict:
        """The slot-table keywords of ``kvcanary.plan`` (arrays through ``convert``)."""
        if self.block_table is None:
            return {"req_to_token": convert(self.req_to_token)}
        return {"block_table": convert(self.block_table), "block_size": self.block_size}

    @property
    def num_sweep_entries(self) -> int:
        return 0 if self.sweep_slot_indices is None else int(self.sweep_slot_indices.shape[0])

    def string(self, key: str, default: str | None = None) -> str | None:
        """An extra (e.g. ``synth_``) string value."""
        value = self.extra.get(key)
        return default if value is None else str(value)


def flavour_of(path) -> str:
    """``npz``, ``safetensors`` or ``dir`` (anything else: a directory of ``.npy``)."""
    name = str(path)
    if name.endswith(".npz"):
        return "npz"
    if name.endswith(".safetensors"):
        return "safetensors"
    return "dir"


# Keys every dump holds.
REQUIRED_KEYS = (VERSION_KEY, "canary", "req_to_token", "req_pool_indices", "seq_lens")
# Every key the format defines (docs/dump-format.md), besides the real-KV sources real_kv_N.
KNOWN_KEYS = (*REQUIRED_KEYS, "block_table", "block_size", "launch_tag", "real_kv_params",
              "real_kv_hash_mode", "swa_window_size", "full_to_swa_index_mapping",
              "expected_tokens", "expected_tokens_valid_lens", "sweep_slot_indices",
              "sweep_prev_slot_indices", "sweep_positions")
REAL_KV_PREFIX = "real_kv_"
# Keys the format leaves to their writers: the user's own, and kvcanary synth's metadata.
# The audit carries them through (Dump.extra) and checks nothing in them.
USER_KEY_PREFIX = "user_"
SYNTH_KEY_PREFIX = "synth_"


def check_key_names(path: str, keys) -> None:
    """Refuse a key the format does not define, naming the nearest one it does (a misspelt
    optional key would otherwise be saved and silently ignored by the audit)."""
    for key in keys:
        if is_read_key(key):
            continue
        near = difflib.get_close_matches(key, KNOWN_KEYS, n=1, cutoff=0.6)
        hint = f"did you mean {near[0]}? " if near else ""
        raise DumpError(f"{path}: key {key}: not a dump key ({hint}keys of your own start "
                        f"with {USER_KEY_PREFIX}, e.g. {USER_KEY_PREFIX}{key}; "
                        "docs/dump-format.md lists every key)")


# Keys whose dtype is int64: narrower integers are widened on save and on load alike.
INT64_KEYS = (VERSION_KEY, "req_pool_indices", "seq_lens", "real_kv_params", "swa_window_size",
              "full_to_swa_index_mapping", "expected_tokens_valid_lens", "sweep_slot_indices",
              "sweep_prev_slot_indices", "sweep_positions")


def is_read_key(key: str) -> bool:
    """A key the format defines, or leaves to its writers: a reader skips every other key
    without reading it (an ignored key that inflates to gigabytes costs nothing)."""
    return key in KNOWN_KEYS or key.startswith((REAL_KV_PREFIX, SYNTH_KEY_PREFIX, USER_KEY_PREFIX))


def widen(values: dict) -> dict:
    """``values`` with the int64 keys' narrower integer arrays (int8..int32, uint8..uint32)
    as int64: every value fits, so nothing is lost. Other dtypes are left for the checker."""
    widened = dict(values)
    for key in INT64_KEYS:
        value = widened.get(key)
        if value is not None and value.dtype.kind in "iu" and value.dtype != np.int64 \
                and np.can_cast(value.dtype, np.int64):
            present = getattr(value, "present_rows", None)
            if present is None or value.ndim == 0:
                widened[key] = value.astype(np.int64)
                continue
            # A sparse file's holes stay unread: zeros the system hands out untouched.
            wide = np.zeros(value.shape, np.int64)
            for begin, end in present:
                wide[begin:end] = value[begin:end]
            widened[key] = wide
    return widened
