"""An independent, sequential pure-Python model of plan, write and verify.

Written from the algorithms of docs/format.md (§7, §8, §9) and docs/extensions.md,
with Python ints and explicit loops, sharing no code with ``kvcanary`` (not even its
splitmix64). Tests compare the vectorised reference (and later the kernels) against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

M = (1 << 64) - 1
ANCHOR = 0xC0FFEE1234567890
OUT_OF_TABLE = (1 << 63) - 1

CHAIN, POSITION, REAL_KV = 1, 2, 4
W_TOKEN, W_POSITION, V_TOKEN = 8, 16, 32
OUT_OF_RANGE = 64
SLOT_CONFLICT = 256


def sm64(x: int) -> int:
    x &= M
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)


def mix3(a: int, b: int, c: int) -> int:
    return sm64(sm64(sm64(a) ^ (b & M)) ^ (c & M))


HEAD = sm64(ANCHOR)


def s64(x: int) -> int:
    x &= M
    return x - (1 << 64) if x >> 63 else x


# ---------------------------------------------------------------- state snapshots

@dataclass
class State:
    """Plain-Python copy of everything a launch may change."""

    records: list  # per slot [token, position, prev_hash, real_kv] as signed ints
    ring: list  # ring_capacity rows of 8 ints
    write_index: int
    slot_counter: int
    kernel_counter: int
    pending: list = field(default_factory=list)

    def commit(self) -> None:
        base = self.write_index
        for k, row in enumerate(self.pending):
            if 0 <= base + k < len(self.ring):
                self.ring[base + k] = [s64(v) for v in row]
        self.write_index = base + len(self.pending)
        self.pending = []


def snapshot(ctx) -> State:
    recs = ctx.canary_buf.view("<i8")[:, :4]
    return State(
        records=[[int(v) for v in r] for r in recs],
        ring=[[int(v) for v in r] for r in ctx.violation_log.ring],
        write_index=int(ctx.violation_log.write_index[0]),
        slot_counter=int(ctx.slot_run_counter[0]),
        kernel_counter=int(ctx.kernel_run_counter[0]),
    )


def assert_matches(ctx, state: State) -> None:
    """The context's buffer, ring and counters equal the oracle's, byte for byte."""
    recs = ctx.canary_buf.view("<i8")[:, :4]
    got = [[int(v) for v in r] for r in recs]
    for slot, (g, w) in enumerate(zip(got, state.records)):
        assert g == w, f"slot {slot}: got {g}, oracle {w}"
    ring = [[int(v) for v in r] for r in ctx.violation_log.ring]
    assert ring == state.ring
    assert int(ctx.violation_log.write_index[0]) == state.write_index
    assert int(ctx.slot_run_counter[0]) == state.slot_counter
    assert int(ctx.kernel_run_counter[0]) == state.kernel_counter


# ---------------------------------------------------------------- real KV

def _slot_bytes(source, slot: int, count: int) -> bytes:
    t = source.tensor
    raw = np.lib.stride_tricks.as_strided(  # the byte rows, row stride from the array
        t.view(np.uint8) if t.dtype != np.uint8 else t,
        shape=(t.shape[0], t.shape[1] * t.dtype.itemsize),
        strides=(t.strides[0], 1))
    row = slot // source.page_size
    begin = (slot % source.page_size) * source.num_bytes_per_token
    return bytes(raw[row, begin:begin + count])


def outside_sources(sources, mode: int, slot: int) -> bool:
    """Hashing is on and some source has no row for the slot's page."""
    return mode != 0 and any(slot // s.page_size >= s.tensor.shape[0] for s in sources)


def real_kv(sources, mode: int, slot: int) -> int:
    if mode == 0 or not sources or outside_sources(sources, mode, slot):
        return 0
    acc = 0
    for src in sources:
        width = 16 if mode == 1 else src.read_bytes
        data = _slot_bytes(src, slot, width)
        per = 0
        for w in range(0, width, 8):
            per = sm64(per ^ int.from_bytes(data[w:w + 8], "little"))
        acc = sm64(acc ^ per)
    return s64(acc)


def link_of(record) -> int:
    token, position, prev_hash = record[0], record[1], record[2]
    return mix3(prev_hash, token, position)


# ---------------------------------------------------------------- write

def write(state: State, ctx, plan, input_ids, positions, out_cache_loc,
          expected_tokens=None, expected_positions=None) -> None:
    kind = int(ctx.kernel_kind)
    n_slots = len(state.records)
    sources, mode = ctx.real_kv_sources, int(ctx.real_kv_hash_mode)
    flag = int(ctx.enable_chain_position_assert[0])
    offsets = [int(v) for v in plan.write_offsets]
    seeds = [int(v) for v in plan.write_seed_slot_indices]
    cap = len(seeds)
    ids = [int(v) for v in input_ids]
    pos_ = [int(v) for v in positions]
    loc = [int(v) for v in out_cache_loc]
    check = expected_tokens is not None
    state.kernel_counter += 1
    active = max(0, min(int(plan.write_num_valid_reqs[0]), cap))
    if active <= 0 or offsets[active] <= 0:
        return
    spans = [(r, offsets[r], offsets[r + 1]) for r in range(active)
             if offsets[r + 1] > offsets[r]]
    inside = [(r, start, end) for r, start, end in spans if start >= 0 and end <= len(ids)]
    # kvcanary's order-free rules: every seed is read before anything is stored, and the
    # last write to a slot in (request, entry) order keeps it.
    seed_records = {seeds[r]: list(state.records[seeds[r]]) for r, _, _ in inside
                    if 0 <= seeds[r] < n_slots}
    keeper = {loc[i]: i for _, start, end in inside for i in range(start, end)
              if 0 <= loc[i] < n_slots}
    keeper_request = {loc[i]: r for r, start, end in inside for i in range(start, end)
                      if 0 <= loc[i] < n_slots}
    # With chain_across_requests a seed is what the requests before it left in the slot.
    across = getattr(ctx, "chain_across_requests", False)
    sequential = {}
    written = 0
    for r, start, end in spans:
        if start < 0 or end > len(ids):
            state.pending.append([kind, -1, 0, 0, 0, 0, start if start < 0 else end,
                                  OUT_OF_RANGE])
            continue
        seed = seeds[r]
        running, do_pos, running_pos = HEAD, False, 0
        if seed >= n_slots:
            state.pending.append([kind, seed, 0, 0, 0, 0, seed, OUT_OF_RANGE])
        elif seed >= 0:
            record = sequential[seed] if across and seed in sequential else seed_records[seed]
            running = link_of(record)
            do_pos = flag != 0
            running_pos = record[1]
        for i in range(start, end):
            slot = loc[i]
            if slot < 0:
                continue
            tok, pos = ids[i], pos_[i]
            if check:
                et, ep = int(expected_tokens[i]), int(expected_positions[i])
                bits = (W_TOKEN if tok != et else 0) | (W_POSITION if pos != ep else 0)
                if bits:
                    state.pending.append([kind, slot, pos, tok, et, running, ep, bits])
            if do_pos:
                if pos != running_pos + 1:
                    state.pending.append([kind, slot, pos, tok, tok, running, running_pos + 1,
                                          W_POSITION])
                running_pos = pos
            if slot >= n_slots or outside_sources(sources, mode, slot):
                state.pending.append([kind, slot, pos, tok, tok, running, slot, OUT_OF_RANGE])
            if 0 <= slot < n_slots:
                sequential[slot] = [tok, pos, s64(running)]
            if slot >= n_slots:
                pass  # never stored
            elif (keeper_request[slot], keeper[slot]) == (r, i):
                state.records[slot] = [tok, pos, s64(running), real_kv(sources, mode, slot)]
                written += 1
            else:
                k = keeper[slot]
                if slot != 0 and ctx.extensions:  # padding slot 0 takes many writes
                    state.pending.append([kind, slot, pos, tok, ids[k], running, pos_[k],
                                          SLOT_CONFLICT])
                written += 1
            running = mix3(running, tok, pos)
    state.slot_counter += written
    state.commit()


# ---------------------------------------------------------------- verify

def verify(state: State, ctx, plan, check_expected_token: bool) -> None:
    kind = int(ctx.kernel_kind)
    n_slots = len(state.records)
    hashing = int(ctx.real_kv_hash_mode) != 0 and len(ctx.real_kv_sources) > 0
    state.kernel_counter += 1
    if int(plan.enable[0]) == 0:
        return
    cap = plan.verify_slot_indices.shape[0]
    active = max(0, min(int(plan.verify_num_valid[0]), cap))
    if active == 0:
        return
    state.slot_counter += active
    for e in range(active):
        slot = int(plan.verify_slot_indices[e])
        exp_pos = int(plan.verify_expected_positions[e])
        prev = int(plan.verify_prev_slot_indices[e])
        exp_tok = int(plan.verify_expected_tokens[e]) if check_expected_token else -1
        if slot == 0:
            continue
        if slot < 0 or slot >= n_slots:
            state.pending.append([kind, slot, exp_pos, 0, exp_tok, 0, slot, OUT_OF_RANGE])
            continue
        tok, pos, prev_hash, rkv = state.records[slot]
        bits = 0
        aux = prev_hash
        if prev < 0:
            aux = s64(HEAD)
            bits |= CHAIN if prev_hash != aux else 0
        elif prev >= n_slots:
            aux = prev
            bits |= OUT_OF_RANGE
        elif prev > 0:
            aux = s64(link_of(state.records[prev]))
            bits |= CHAIN if prev_hash != aux else 0
        if exp_tok != -1 and tok != exp_tok:
            bits |= V_TOKEN
        if pos != exp_pos:
            bits |= POSITION
        expected_rkv = real_kv(ctx.real_kv_sources, int(ctx.real_kv_hash_mode), slot) \
            if hashing else 0
        if hashing and outside_sources(ctx.real_kv_sources, int(ctx.real_kv_hash_mode), slot):
            bits |= OUT_OF_RANGE  # no bytes to compare against
            if prev < n_slots:  # an out-of-range predecessor keeps its index
                aux = slot
        elif rkv != expected_rkv:
            bits |= REAL_KV
        if bits:
            state.pending.append([kind, slot, pos, tok, exp_tok, prev_hash, aux, bits])
    state.commit()


# ---------------------------------------------------------------- plan

@dataclass
class PlanResult:
    slots: list
    tokens: list
    positions: list
    prevs: list
    num_valid: int
    enable: int
    offsets: list
    seeds: list
    num_valid_reqs: int


def plan(verify_plan, write_plan, req_pool_indices, prefix_lens, extend_seq_lens,
         req_to_token, swa_window_size=0, lut=None, pool=None, valid_lens=None,
         offset=0) -> PlanResult:
    """The plan arrays after a launch, starting from the given plans' current contents."""
    table = [[int(v) for v in row] for row in req_to_token]
    max_reqs = len(table)
    width = req_to_token.shape[1]

    def read(rp, col):
        if 0 <= rp < max_reqs and 0 <= col < width:
            return table[rp][col]
        return OUT_OF_TABLE

    def translate(x):
        if lut is None or x < 0 or x == OUT_OF_TABLE:
            return x
        if x >= len(lut):
            raise ValueError("SWA slot outside the LUT")
        return int(lut[x])

    bs = len(req_pool_indices)
    slots = [int(v) for v in verify_plan.verify_slot_indices]
    tokens = [int(v) for v in verify_plan.verify_expected_tokens]
    positions = [int(v) for v in verify_plan.verify_expected_positions]
    prevs = [int(v) for v in verify_plan.verify_prev_slot_indices]
    cap = len(slots)
    entries = []
    for r in range(bs):
        rp, p = int(req_pool_indices[r]), int(prefix_lens[r])
        if rp == 0:
            continue
        ws = max(0, p - swa_window_size) if swa_window_size > 0 else 0
        for position in range(ws, p):
            slot = translate(read(rp, position))
            prev = translate(read(rp, position - 1)) if position > 0 else -1
            tok = -1
            if pool is not None:
                q = position + offset
                if 0 <= q < int(valid_lens[r]) and q < pool.shape[1] \
                        and 0 <= rp < pool.shape[0]:
                    tok = int(pool[rp, q])
            entries.append((slot, tok, position, prev))
    if len(entries) > cap:
        num_valid, enable = cap, 0
    else:
        num_valid, enable = len(entries), 1
        for t, (slot, tok, position, prev) in enumerate(entries):
            slots[t], tokens[t], positions[t], prevs[t] = slot, tok, position, prev
    wcap = write_plan.write_seed_slot_indices.shape[0]
    offsets = [0] * (wcap + 1)
    seeds = [int(v) for v in write_plan.write_seed_slot_indices]
    total = 0
    for r in range(bs):
        rp, p, e = int(req_pool_indices[r]), int(prefix_lens[r]), int(extend_seq_lens[r])
        if rp != 0:
            total += max(0, e)
        offsets[r + 1] = total
        seeds[r] = translate(read(rp, p - 1)) if (rp != 0 and p > 0 and e > 0) else -1
    return PlanResult(slots, tokens, positions, prevs, num_valid, enable, offsets, seeds, bs)


def assert_plan_matches(verify_plan, write_plan, want: PlanResult) -> None:
    assert [int(v) for v in verify_plan.verify_slot_indices] == want.slots
    assert [int(v) for v in verify_plan.verify_expected_tokens] == want.tokens
    assert [int(v) for v in verify_plan.verify_expected_positions] == want.positions
    assert [int(v) for v in verify_plan.verify_prev_slot_indices] == want.prevs
    assert int(verify_plan.verify_num_valid[0]) == want.num_valid
    assert int(verify_plan.enable[0]) == want.enable
    assert [int(v) for v in write_plan.write_offsets] == want.offsets
    assert [int(v) for v in write_plan.write_seed_slot_indices] == want.seeds
    assert int(write_plan.write_num_valid_reqs[0]) == want.num_valid_reqs
