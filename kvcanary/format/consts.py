"""Constants and enums of the canary format.

Every value here is a fact of the upstream (SGLang) canary format, except the
``FailReason`` bits marked as kvcanary extensions. ``kernels/kvc_consts.cuh`` holds the
same values for the CUDA side; ``tests/format/test_const_sync.py`` keeps the two files equal.
"""

from __future__ import annotations

import enum

CANARY_CHAIN_ANCHOR = 0xC0FFEE1234567890
REQ_POOL_IDX_PADDING = 0
TOKEN_TO_KV_SLOT_PADDING = 0

CANARY_FIELDS_PER_SLOT = 4
CANARY_FIELD_TOKEN = 0
CANARY_FIELD_POSITION = 1
CANARY_FIELD_PREV_HASH = 2
CANARY_FIELD_REAL_KV_HASH = 3
CANARY_SLOT_BYTES = CANARY_FIELDS_PER_SLOT * 8

VIOLATION_FIELDS = 8
# The violation write index saturates here (INT32_MAX) instead of wrapping to negative.
VIOLATION_WRITE_INDEX_MAX = (1 << 31) - 1
VIOLATION_FIELD_KERNEL_KIND = 0
VIOLATION_FIELD_SLOT_IDX = 1
VIOLATION_FIELD_POSITION = 2
VIOLATION_FIELD_STORED_TOKEN = 3
VIOLATION_FIELD_EXPECTED_TOKEN = 4
VIOLATION_FIELD_STORED_CHAIN_HASH = 5
VIOLATION_FIELD_EXPECTED_AUX = 6
VIOLATION_FIELD_FAIL_REASON_BITS = 7

# Default bound on real-KV sources (upstream's fixed ABI width) and the largest bound a
# kernel variant may be compiled for.
MAX_REAL_KV_SOURCES = 4
MAX_REAL_KV_SOURCES_LIMIT = 64
REAL_KV_SOURCE_FIELDS_PER_ENTRY = 3
REAL_KV_SOURCE_FIELD_PAGE_SIZE = 0
REAL_KV_SOURCE_FIELD_NUM_BYTES_PER_TOKEN = 1
REAL_KV_SOURCE_FIELD_READ_BYTES = 2
# PARTIAL mode always hashes exactly this many leading bytes per slot and source.
REAL_KV_PARTIAL_READ_BYTES = 16
# Loads are 16-byte aligned: per-token widths, read widths and row strides are multiples.
REAL_KV_ALIGN_BYTES = 16

# Expected-token sentinel: "no expected token known, skip the token check".
EXPECTED_TOKEN_UNKNOWN = -1
# kvcanary extension: the plan's marker for a req_to_token read outside the table.
# It is a slot index no canary buffer can hold, so verify and write report it as
# SLOT_OUT_OF_RANGE instead of reading memory that does not belong to the table.
PLAN_SLOT_OUT_OF_TABLE = (1 << 63) - 1

SPLITMIX64_SHIFT_1 = 30
SPLITMIX64_MUL_1 = 0xBF58476D1CE4E5B9
SPLITMIX64_SHIFT_2 = 27
SPLITMIX64_MUL_2 = 0x94D049BB133111EB
SPLITMIX64_SHIFT_3 = 31


class FailReason(enum.IntFlag):
    """Bits of a violation row's ``fail_reason_bits`` (upstream names and values)."""

    VERIFY_CHAIN_HASH_MISMATCH = 1 << 0
    VERIFY_POSITION_MISMATCH = 1 << 1
    VERIFY_REAL_KV_HASH_MISMATCH = 1 << 2
    WRITE_TOKEN_MISMATCH = 1 << 3
    WRITE_POSITION_MISMATCH = 1 << 4
    VERIFY_TOKEN_MISMATCH = 1 << 5
    # kvcanary extensions (not upstream): see docs/extensions.md.
    SLOT_OUT_OF_RANGE = 1 << 6
    SLOT_ZERO_IN_PREFIX = 1 << 7
    WRITE_SLOT_CONFLICT = 1 << 8


class RealKvHashMode(enum.IntEnum):
    """How much of a slot's real KV a record's hash covers: ``NONE`` (not hashed, the field
    is 0), ``PARTIAL`` (the first REAL_KV_PARTIAL_READ_BYTES bytes per source), ``ALL``."""
    NONE = 0
    PARTIAL = 1
    ALL = 2


class LaunchTag(enum.IntEnum):
    """Which launch a violation row came from (a context's ``kernel_kind``): where in the
    step (HEAD, TAIL; SWEEP for prefix-cache entries), which half (K, V) and pool group."""
    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11


WRITE_FAIL_BITS = FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH
TOKEN_FAIL_BITS = FailReason.WRITE_TOKEN_MISMATCH | FailReason.VERIFY_TOKEN_MISMATCH
