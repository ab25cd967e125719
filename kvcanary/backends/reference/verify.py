"""Verify (docs/format.md §9): re-read each planned prefix slot and check its record.

Per entry, the rules:
  expected_chain   H0 for a chain head (prev < 0), link(prev record) for a reachable
                   predecessor, the stored prev_hash itself when prev == 0 (unreachable)
  check bits       chain / token / position / real-KV, ORed
  out of range     kvcanary extension: a slot or predecessor outside the buffer is
                   reported as SLOT_OUT_OF_RANGE and never read; a slot outside a real-KV
                   source is reported too, its other checks run, its bytes are never read

Every rule runs over all entries at once; entries that a rule must not touch (slot 0,
out-of-range indices) read a clamped in-range record and are masked out afterwards.
"""

from __future__ import annotations

import numpy as np

from ...format.consts import EXPECTED_TOKEN_UNKNOWN, TOKEN_TO_KV_SLOT_PADDING, VIOLATION_FIELDS
from ...format.bits import (VERIFY_CHAIN_HASH_MISMATCH as _CHAIN, VERIFY_TOKEN_MISMATCH as _TOKEN,
                            VERIFY_POSITION_MISMATCH as _POSITION,
                            VERIFY_REAL_KV_HASH_MISMATCH as _REAL_KV,
                            SLOT_OUT_OF_RANGE as _OUT_OF_RANGE)
from ...format.hashing import CHAIN_HEAD
from ...format.rules import canary_fields, violation_rows
from .chain_compiled import link_inplace
from .realkv import hash_inside, outside_sources
from .ring import commit_rows


def active_entries(plan) -> int:
    """Entries this launch checks: 0 when disabled, else num_valid clamped to capacity."""
    if int(plan.enable[0]) == 0:
        return 0
    return max(0, min(int(plan.verify_num_valid[0]), plan.verify_capacity))


def load_records(fields: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``int64[n, 4]`` records of ``slots`` clamped into the buffer (callers mask the
    entries whose slot was out of range)."""
    if fields.shape[0] == 0:  # no slot is in range: every entry is masked
        return np.zeros((slots.shape[0], fields.shape[1]), dtype=fields.dtype)
    return fields.take(slots, axis=0, mode="clip")   # clamps into [0, slots): no copy of them


def expected_chain(fields: np.ndarray, prev: np.ndarray, stored_prev_hash: np.ndarray) -> np.ndarray:
    """uint64 chain link each entry's stored prev_hash must equal: H0 for a chain head,
    the link of the predecessor's record, or the stored value itself (a vacuous check)
    when the predecessor is unreachable (0) or out of range."""
    record = load_records(fields, prev)
    chain = link_inplace(record[:, 2].copy().view(np.uint64),
                         record[:, 0].view(np.uint64), record[:, 1].view(np.uint64))
    np.copyto(chain, stored_prev_hash.view(np.uint64), where=(prev == 0) | (prev >= fields.shape[0]))
    np.copyto(chain, np.uint64(CHAIN_HEAD), where=prev < 0)
    return chain


def verify_reference(context, plan, *, check_expected_token: bool) -> None:
    context.kernel_run_counter[0] += 1
    active = active_entries(plan)
    if active == 0:
        return
    context.slot_run_counter[0] += active  # slot-0 entries are counted too
    if check_expected_token:
        expected_token = plan.verify_expected_tokens[:active]
    else:
        expected_token = np.full(active, EXPECTED_TOKEN_UNKNOWN, dtype=np.int64)
    _, rows = entry_rows(context, plan.verify_slot_indices[:active],
                         plan.verify_expected_positions[:active],
                         plan.verify_prev_slot_indices[:active], expected_token)
    if rows.shape[0]:
        commit_rows(context.violation_log, rows)


def entry_rows(context, slot, expected_position, prev, expected_token) -> tuple:
    """``(failed, rows)``: the indices of the entries that fail their checks and the ring row
    each produces (``int64[len(failed), 8]``, in entry order). An entry's row depends on the
    entry and the buffer alone, so entries may share slots; nothing is written."""
    active = slot.shape[0]
    fields = canary_fields(context.canary_buf)
    num_slots = fields.shape[0]
    record = load_records(fields, slot)
    stored_token, stored_position = record[:, 0], record[:, 1]
    stored_prev_hash = np.ascontiguousarray(record[:, 2])
    stored_real_kv = record[:, 3]
    chain = expected_chain(fields, prev, stored_prev_hash).view(np.int64)
    slot_out = (slot < 0) | (slot >= num_slots)
    prev_out = prev >= num_slots

    # Each rule's bit where it fails, one select and one OR per rule.
    bits = np.where(stored_prev_hash != chain, _CHAIN, 0)
    bits |= np.where((expected_token != EXPECTED_TOKEN_UNKNOWN)
                     & (stored_token != expected_token), _TOKEN, 0)
    bits |= np.where(stored_position != expected_position, _POSITION, 0)
    source_out = outside_sources(context.real_kv_sources, context.real_kv_hash_mode, slot)
    if context.hashing:
        real_kv = np.zeros(active, dtype=np.uint64)
        # A slot outside a source hashes to 0 unread, as real_kv_hash has it.
        hashed = (~(slot_out | source_out) & (slot != TOKEN_TO_KV_SLOT_PADDING)).nonzero()[0]
        real_kv[hashed] = hash_inside(context.real_kv_sources, context.real_kv_hash_mode,
                                      slot[hashed])
        bits |= np.where((stored_real_kv != real_kv.view(np.int64)) & ~source_out, _REAL_KV, 0)
    else:
        bits |= np.where(stored_real_kv != 0, _REAL_KV, 0)
    bits |= np.where(prev_out | source_out, _OUT_OF_RANGE, 0)
    bits[slot_out] = _OUT_OF_RANGE  # the record was never read: nothing else is known
    bits[slot == TOKEN_TO_KV_SLOT_PADDING] = 0  # unfilled: skipped

    failed = bits.nonzero()[0]
    if failed.size == 0:    # most launches: no row to build
        return failed, np.zeros((0, VIOLATION_FIELDS), dtype=np.int64)
    out = slot_out[failed]
    return failed, violation_rows(
        context.kernel_kind,
        slot[failed],
        np.where(out, expected_position[failed], stored_position[failed]),
        np.where(out, 0, stored_token[failed]),
        expected_token[failed],
        np.where(out, 0, stored_prev_hash[failed]),
        np.where(out | (source_out[failed] & ~prev_out[failed]), slot[failed],
                 np.where(prev_out[failed], prev[failed], chain[failed])),
        bits[failed],
    )
