"""Write (docs/format.md §8): stamp each new token's record and advance its request's chain.

Per request, the rules:
  seed link      H0 without a seed (seed < 0), else link(seed record)
  skip           out_cache_loc < 0: no store, no chain advance, not counted
  input assert   token / position against the expected inputs (when given)
  position chain with a seed and the flag set: each position is the previous + 1
  store          (token, position, running hash, real-KV hash); then the running hash
                 advances over the actual token and position
  out of range   kvcanary extension: a slot or seed outside the buffer, or a request whose
                 range leaves the token arrays, is reported as SLOT_OUT_OF_RANGE, never touched;
                 so is a slot outside a real-KV source, stored with real-KV hash 0
  conflict       when writes of one launch share a slot, the last one in (request, entry)
                 order keeps it; kvcanary extension: every other is a WRITE_SLOT_CONFLICT row,
                 except on padding slot 0 (padded tokens all write there) and with the
                 context's extensions off

Order-free: every seed is read before any record of the launch is stored, so the result
never depends on which request runs first. With the context's ``chain_across_requests``, a
seed slot that an earlier request of the launch writes links to that write instead (the
last such write in (request, entry) order), as if requests ran one after another. The chain is serial within a request; the loop
runs over token index, vectorised across requests. Violation rows are appended in
upstream's order: request, entry, then rule.
"""

from __future__ import annotations

import numpy as np

from ...format.consts import TOKEN_TO_KV_SLOT_PADDING
from ...format.bits import (SLOT_OUT_OF_RANGE as _OUT_OF_RANGE, WRITE_TOKEN_MISMATCH as _TOKEN,
                            WRITE_POSITION_MISMATCH as _POSITION, WRITE_SLOT_CONFLICT as _CONFLICT)
from ...format.hashing import CHAIN_HEAD
from ...format.rules import canary_fields, violation_rows
from .chain_compiled import mix3_inplace
from .realkv import outside_sources, real_kv_hash
from .ring import commit_rows


# Row order inside one request: its range or seed problems first, then per entry the
# input assert, the chain-position assert, the out-of-range slot and the slot conflict.
_RULE_RANGE, _RULE_SEED, _RULE_INPUT, _RULE_CHAIN_POSITION, _RULE_SLOT, _RULE_CONFLICT = range(6)


class _Rows:
    """Violation rows with their (request, entry, rule) sort key."""

    def __init__(self):
        self.keys, self.rows = [], []

    def add(self, request, entry, rule, rows):
        if rows.shape[0]:
            key = np.broadcast_arrays(np.asarray(request, np.int64), np.asarray(entry, np.int64),
                                      np.full(rows.shape[0], rule, np.int64))
            self.keys.append(np.stack(key, axis=-1).reshape(-1, 3))
            self.rows.append(rows)

    def ordered(self) -> np.ndarray:
        if not self.rows:
            return np.zeros((0, 8), dtype=np.int64)
        keys = np.concatenate(self.keys)
        order = np.lexsort((keys[:, 2], keys[:, 1], keys[:, 0]))
        return np.concatenate(self.rows)[order]


def write_reference(context, plan, *, input_ids, positions, out_cache_loc,
                    expected_input_tokens=None, expected_input_positions=None) -> None:
    context.kernel_run_counter[0] += 1
    active = max(0, min(int(plan.write_num_valid_reqs[0]), plan.write_req_capacity))
    if active <= 0 or int(plan.write_offsets[active]) <= 0:
        return

    kind = context.kernel_kind
    rows = _Rows()
    starts = plan.write_offsets[:active]
    ends = plan.write_offsets[1:active + 1]
    requests = (ends > starts).nonzero()[0]
    num_tokens = input_ids.shape[0]
    outside = (starts[requests] < 0) | (ends[requests] > num_tokens)
    if outside.any():
        bad = requests[outside]
        rows.add(bad, -1, _RULE_RANGE, violation_rows(
            kind, -1, 0, 0, 0, 0, np.where(starts[bad] < 0, starts[bad], ends[bad]),
            _OUT_OF_RANGE))
        requests = requests[~outside]

    batch = _Batch(context, plan, starts, ends, input_ids, positions, out_cache_loc,
                   expected_input_tokens, expected_input_positions)
    context.slot_run_counter[0] += batch.run(requests, rows)
    commit_rows(context.violation_log, rows.ordered())


class _Batch:
    def __init__(self, context, plan, starts, ends, input_ids, positions, out_cache_loc,
                 expected_tokens, expected_positions):
        self.context = context
        self.fields = canary_fields(context.canary_buf)
        self.seeds = plan.write_seed_slot_indices
        self.starts, self.ends = starts, ends
        self.input_ids, self.positions, self.out_cache_loc = input_ids, positions, out_cache_loc
        self.expected_tokens, self.expected_positions = expected_tokens, expected_positions
        self.position_assert = int(context.enable_chain_position_assert[0]) != 0
        self.report_conflicts = context.extensions
        self.chain_across = bool(getattr(context, "chain_across_requests", False))

    def entries(self, requests: np.ndarray):
        """Flat token indices of the requests' kept entries (slot >= 0), grouped by request."""
        counts = self.ends[requests] - self.starts[requests]
        request_of = np.arange(requests.size).repeat(counts)
        first = counts.cumsum() - counts
        entry = np.arange(request_of.size) - first[request_of]
        index = self.starts[requests][request_of] + entry
        kept = self.out_cache_loc[index] >= 0
        return request_of[kept], entry[kept], index[kept]

    def run(self, requests: np.ndarray, rows: _Rows) -> int:
        """Write the requests' entries; returns how many writes landed inside the buffer
        (a write that loses its slot to a later one of the launch still counts)."""
        kind, fields = self.context.kernel_kind, self.fields
        num_slots = fields.shape[0]
        request_of, entry, index = self.entries(requests)
        slot = self.out_cache_loc[index]
        token, position = self.input_ids[index], self.positions[index]
        request_id = requests[request_of]

        # Seeds, all read before anything is stored: link of the seed record, or H0.
        seed = self.seeds[requests]
        seed_out = seed >= num_slots
        if seed_out.any():
            rows.add(requests[seed_out], -1, _RULE_SEED, violation_rows(
                kind, seed[seed_out], 0, 0, 0, 0, seed[seed_out], _OUT_OF_RANGE))
        seeded = ((seed >= 0) & ~seed_out).nonzero()[0]
        running = np.full(requests.size, CHAIN_HEAD, dtype=np.uint64)
        seed_record = fields[seed[seeded]]
        running[seeded] = mix3_inplace(seed_record[:, 2].view(np.uint64).copy(),
                                       seed_record[:, 0].view(np.uint64),
                                       seed_record[:, 1].view(np.uint64))

        prev_hash = _chain(running, request_of, token, position)
        seed_position = np.zeros(requests.size, dtype=np.int64)
        seed_position[seeded] = seed_record[:, 1]
        if self.chain_across and seeded.size:
            prev_hash = _chain_across(running, seed_position, seed, seeded, request_of, slot,
                                      num_slots, token, position, prev_hash)

        if self.expected_tokens is not None:
            expected_token = self.expected_tokens[index]
            expected_position = self.expected_positions[index]
            bits = (np.where(token != expected_token, _TOKEN, 0)
                    | np.where(position != expected_position, _POSITION, 0))
            hit = bits.nonzero()[0]
            if hit.size:
                rows.add(request_id[hit], entry[hit], _RULE_INPUT, violation_rows(
                    kind, slot[hit], position[hit], token[hit], expected_token[hit],
                    prev_hash[hit], expected_position[hit], bits[hit]))

        if self.position_assert and seeded.size:
            # Expected position: the previous kept entry's actual position + 1 (the seed's
            # for a request's first entry), so one bad token is one violation.
            has_seed = np.zeros(requests.size, dtype=bool)
            has_seed[seeded] = True
            previous = np.empty_like(position)
            previous[1:] = position[:-1]
            first_of_request = np.ones(position.size, dtype=bool)
            first_of_request[1:] = request_of[1:] != request_of[:-1]
            previous[first_of_request] = seed_position[request_of[first_of_request]]
            expected = previous + 1
            hit = (has_seed[request_of] & (position != expected)).nonzero()[0]
            if hit.size:
                rows.add(request_id[hit], entry[hit], _RULE_CHAIN_POSITION, violation_rows(
                    kind, slot[hit], position[hit], token[hit], token[hit], prev_hash[hit],
                    expected[hit], _POSITION))

        slot_out = slot >= num_slots
        # A slot outside the buffer is never stored; one outside a real-KV source is
        # stored with real-KV hash 0 (its bytes are not read). Both are reported alike.
        sources, mode = self.context.real_kv_sources, self.context.real_kv_hash_mode
        source_out = outside_sources(sources, mode, slot)
        hit = (slot_out | source_out).nonzero()[0]
        if hit.size:
            rows.add(request_id[hit], entry[hit], _RULE_SLOT, violation_rows(
                kind, slot[hit], position[hit], token[hit], token[hit], prev_hash[hit],
                slot[hit], _OUT_OF_RANGE))

        inside = (~slot_out).nonzero()[0]
        keeper = inside[_last_writer(slot[inside])]
        lost = ((keeper != inside) & (slot[inside] != TOKEN_TO_KV_SLOT_PADDING)).nonzero()[0]
        hit, kept = inside[lost], keeper[lost]
        if self.report_conflicts and hit.size:
            rows.add(request_id[hit], entry[hit], _RULE_CONFLICT, violation_rows(
                kind, slot[hit], position[hit], token[hit], token[kept], prev_hash[hit],
                position[kept], _CONFLICT))

        stored = inside[keeper == inside]     # each slot's last write, in entry order
        _store(fields, slot[stored], token[stored], position[stored], prev_hash[stored],
               real_kv_hash(sources, mode, slot[stored], source_out[stored]))
        return int(inside.size)


def _chain_across(running, seed_position, seed, seeded, request_of, slot, num_slots, token,
                  position, prev_hash) -> np.ndarray:
    """prev_hash of every entry when seeds chain across requests: a request whose seed slot
    an earlier request of the launch writes starts from that write's link (the last such
    write), and its seed position is that write's position; ``running`` and
    ``seed_position`` are updated in place. Requests resolve in order, so a writer's own
    seed is final before its link is taken."""
    inside = np.flatnonzero((slot >= 0) & (slot < num_slots))
    hit = seeded[np.isin(seed[seeded], slot[inside])]
    if hit.size == 0:
        return prev_hash
    writes = {}
    for e in inside[np.isin(slot[inside], seed[hit])].tolist():
        writes.setdefault(int(slot[e]), []).append(e)
    writer = {}
    for j in hit.tolist():
        earlier = [e for e in writes[int(seed[j])] if request_of[e] < j]
        if earlier:
            writer[j] = earlier[-1]      # entries are in (request, entry) order
    depth = {}
    for j in sorted(writer):
        depth[j] = depth.get(int(request_of[writer[j]]), 0) + 1
    for level in range(1, max(depth.values(), default=0) + 1):
        for j in (j for j, d in depth.items() if d == level):
            e = writer[j]
            running[j:j + 1] = mix3_inplace(prev_hash[e:e + 1].copy(), token[e:e + 1].view(
                np.uint64), position[e:e + 1].view(np.uint64))
            seed_position[j] = position[e]
        prev_hash = _chain(running, request_of, token, position)
    return prev_hash


def _chain(running: np.ndarray, request_of: np.ndarray, token, position) -> np.ndarray:
    """prev_hash of every entry: the running hash before it, advanced entry by entry.

    Requests are ranked longest first and entries sorted by (step, rank), so the requests
    still running at step k are a prefix of the ranks and step k is one contiguous slice:
    one in-place mix3 per step over every running request."""
    num_entries = request_of.size
    if num_entries == 0:
        return np.empty(0, dtype=np.uint64)
    lengths = np.bincount(request_of, minlength=running.size)
    if int(lengths.max()) == 1:    # a decode step: each entry is its request's first
        return running[request_of]
    prev_hash = np.empty(num_entries, dtype=np.uint64)
    rank = (-lengths).argsort(kind="stable")
    lane_of_request = np.empty_like(rank)
    lane_of_request[rank] = np.arange(rank.size)
    step = np.arange(num_entries) - (lengths.cumsum() - lengths)[request_of]
    order = np.lexsort((lane_of_request[request_of], step))
    tokens = token.view(np.uint64)[order]
    positions = position.view(np.uint64)[order]
    bounds = np.concatenate(([0], np.bincount(step).cumsum()))
    hashes = np.empty(num_entries, dtype=np.uint64)
    acc = running[rank].copy()
    steps = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    for index, (begin, end) in enumerate(steps):
        lanes = acc[: end - begin]
        hashes[begin:end] = lanes
        if index + 1 < len(steps):   # the last step's advance would be read by no entry
            mix3_inplace(lanes, tokens[begin:end], positions[begin:end])
    prev_hash[order] = hashes
    return prev_hash


def _last_writer(slot: np.ndarray) -> np.ndarray:
    """For every write, the index of the last write to the same slot (itself when alone).
    Writes are in (request, entry) order, so "last" is the largest write id the kernel's
    atomicMax claim keeps."""
    if slot.size == 0:
        return np.zeros(0, dtype=np.int64)
    # A stable sort keeps a slot's writes in launch order: the last of each run of equal
    # slots is its last writer (one sort, where np.unique and np.maximum.at took two passes
    # and a scatter).
    order = slot.argsort(kind="stable")
    ordered = slot[order]
    run_end = np.ones(slot.size, dtype=bool)
    run_end[:-1] = ordered[1:] != ordered[:-1]
    if run_end.all():   # every slot written once (most launches): each write keeps its own
        return np.arange(slot.size)
    ends = run_end.nonzero()[0]
    run_of = np.searchsorted(ends, np.arange(slot.size))
    keeper = np.empty(slot.size, dtype=np.int64)
    keeper[order] = order[ends][run_of]
    return keeper


def _store(fields, slot, token, position, prev_hash, real_kv) -> None:
    """Store one record per slot (the slots are distinct)."""
    fields[slot, 0] = token
    fields[slot, 1] = position
    fields[slot, 2] = prev_hash.view(np.int64)
    fields[slot, 3] = real_kv.view(np.int64)
