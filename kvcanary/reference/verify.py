"""Verify (spec §4.4): re-read each planned prefix slot and check its record.

Per entry, the rules:
  expected_chain   H0 for a chain head (prev < 0), link(prev record) for a reachable
                   predecessor, the stored prev_hash itself when prev == 0 (unreachable)
  check bits       chain / token / position / real-KV, ORed
  out of range     kvcanary extension: a slot or predecessor outside the buffer is
                   reported as SLOT_OUT_OF_RANGE and never read
"""

from __future__ import annotations

import numpy as np

from ..consts import EXPECTED_TOKEN_UNKNOWN, FailReason, TOKEN_TO_KV_SLOT_PADDING
from ..hashing import CHAIN_HEAD, mix3_inplace
from .realkv import real_kv_hash
from .ring import canary_fields, commit_rows, violation_rows


def active_entries(plan) -> int:
    """Entries this launch checks: 0 when disabled, else num_valid clamped to capacity."""
    if int(plan.enable[0]) == 0:
        return 0
    return max(0, min(int(plan.verify_num_valid[0]), plan.verify_capacity))


def expected_chain(fields: np.ndarray, prev: np.ndarray, stored_prev_hash: np.ndarray) -> np.ndarray:
    """uint64 chain link each entry's stored prev_hash must equal."""
    result = np.array(stored_prev_hash, dtype=np.int64).view(np.uint64)  # unreachable: vacuous
    result[prev < 0] = CHAIN_HEAD
    linked = np.flatnonzero((prev > 0) & (prev < fields.shape[0]))
    if linked.size:
        record = fields[prev[linked]]
        acc = record[:, 2].view(np.uint64).copy()
        result[linked] = mix3_inplace(acc, record[:, 0].view(np.uint64), record[:, 1].view(np.uint64))
    return result


def verify_reference(context, plan, *, check_expected_token: bool) -> None:
    context.kernel_run_counter[0] += 1
    active = active_entries(plan)
    if active == 0:
        return
    context.slot_run_counter[0] += active  # slot-0 entries are counted too

    fields = canary_fields(context.canary_buf)
    num_slots = fields.shape[0]
    slot = plan.verify_slot_indices[:active]
    entries = np.flatnonzero(slot != TOKEN_TO_KV_SLOT_PADDING)
    slot = slot[entries]
    expected_position = plan.verify_expected_positions[:active][entries]
    prev = plan.verify_prev_slot_indices[:active][entries]
    if check_expected_token:
        expected_token = plan.verify_expected_tokens[:active][entries]
    else:
        expected_token = np.full(entries.size, EXPECTED_TOKEN_UNKNOWN, dtype=np.int64)

    slot_out = (slot < 0) | (slot >= num_slots)
    inside = np.flatnonzero(~slot_out)
    record = fields[slot[inside]]
    stored_token, stored_position = record[:, 0], record[:, 1]
    stored_prev_hash, stored_real_kv = record[:, 2], record[:, 3]
    prev_in = prev[inside]
    prev_out = prev_in >= num_slots
    chain = expected_chain(fields, prev_in, stored_prev_hash).view(np.int64)
    real_kv = np.zeros(inside.size, dtype=np.int64)
    if context.hashing:
        real_kv = real_kv_hash(context.real_kv_sources, context.real_kv_hash_mode,
                               slot[inside]).view(np.int64)

    exp_tok = expected_token[inside]
    bits = np.zeros(inside.size, dtype=np.int64)
    bits |= np.where((prev_in != 0) & ~prev_out & (stored_prev_hash != chain),
                     int(FailReason.VERIFY_CHAIN_HASH_MISMATCH), 0)
    bits |= np.where((exp_tok != EXPECTED_TOKEN_UNKNOWN) & (stored_token != exp_tok),
                     int(FailReason.VERIFY_TOKEN_MISMATCH), 0)
    bits |= np.where(stored_position != expected_position[inside],
                     int(FailReason.VERIFY_POSITION_MISMATCH), 0)
    bits |= np.where(stored_real_kv != real_kv, int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH), 0)
    bits |= np.where(prev_out, int(FailReason.SLOT_OUT_OF_RANGE), 0)

    failed = np.flatnonzero(bits)
    inside_rows = violation_rows(
        context.kernel_kind, slot[inside][failed], stored_position[failed],
        stored_token[failed], exp_tok[failed], stored_prev_hash[failed],
        np.where(prev_out[failed], prev_in[failed], chain[failed]), bits[failed],
    )
    outside = np.flatnonzero(slot_out)
    outside_rows = violation_rows(
        context.kernel_kind, slot[outside], expected_position[outside], 0,
        expected_token[outside], 0, slot[outside], int(FailReason.SLOT_OUT_OF_RANGE),
    )
    # Rows in entry order, as upstream's reference appends them.
    order = np.argsort(np.concatenate([inside[failed], outside]), kind="stable")
    commit_rows(context.violation_log, np.concatenate([inside_rows, outside_rows])[order])
