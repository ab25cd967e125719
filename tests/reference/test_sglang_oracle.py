"""Differential test against SGLang's published KV-canary reference (tests/sglang_oracle.py).

Seeded random scenarios, drawn the way an engine produces its launches, run on kvcanary's
numpy backend and on SGLang's torch reference functions (``plan_ref``, ``write_ref``,
``verify_ref``) in lockstep; after every launch the canary bytes (stride padding
included), the violation ring, the write index, both counters and the plan arrays must
be equal. Each scenario runs kvcanary with its extensions on or off; a write launch that
writes one non-padding slot twice runs with ``extensions=False`` (upstream's bytes exactly),
since there the extensions add ``WRITE_SLOT_CONFLICT`` rows. A slice of the scenarios runs
the CUDA kernel source compiled for the CPU as well.

A launch that meets one of kvcanary's documented divergences (docs/extensions.md) is
set aside, decided from the launch's inputs before it runs, never from its result; the
scenario stops there and is counted under that reason. A plan both sides refuse
(an SWA slot outside the LUT) compares the error text. The test prints the counts.
"""

from __future__ import annotations

import collections
import sys
import time

import numpy as np
import pytest

import kvcanary as kc
import sglang_oracle
from kernel_harness.fixtures import assert_compared, cpu_kernels, kernels_behind_numpy  # noqa: F401

SCENARIOS = 3000
KERNEL_SCENARIOS = 300  # also through the CPU-compiled kernels
NUM_TAGS = 12

# Documented divergences (docs/extensions.md), each a reason a launch is set aside.
OUT_OF_RANGE = "SLOT_OUT_OF_RANGE: an index outside the canary buffer"
OUTSIDE_SOURCE = "SLOT_OUT_OF_RANGE: a hashed slot outside a real-KV source"
SEED_ORDER = "order-free writes: a seed slot written earlier in the same launch"
CHAINED = ("of them with a seed slot written earlier in the same launch, compared with "
           "chain_across_requests")
CONFLICT = "writes with a slot conflict (compared with extensions=False)"
REFUSED = "plans refused alike (SWA slot outside the LUT), error texts compared"
SMALL_SOURCES = "of them hashing a real-KV source smaller than the canary buffer"
COMPARED = ("launches compared", "scenarios compared to the end", SMALL_SOURCES, REFUSED,
            CONFLICT, CHAINED)


@pytest.fixture(scope="module")
def upstream():
    try:
        return sglang_oracle.oracle()
    except sglang_oracle.Unavailable as exc:
        pytest.skip(f"SGLang {sglang_oracle.version()}'s reference code cannot run here: {exc}")


class SetAside(Exception):
    """This launch meets a documented divergence: stop the scenario, count the reason."""


# ------------------------------------------------------------------ the two sides' state


class Side:
    """One backend's canary state: buffer, log and counters, each side its own copy
    (SGLang's side reaches its arrays as torch tensors over the same memory)."""

    def __init__(self, canary, ring_capacity):
        self.canary = canary.copy()
        self.ring = np.zeros((ring_capacity, 8), np.int64)
        self.write_index = np.zeros(1, np.int32)
        self.slot_counter = np.zeros(1, np.int64)
        self.kernel_counter = np.zeros(1, np.int64)

    def arrays(self):
        return (self.canary, self.ring, self.write_index, self.slot_counter, self.kernel_counter)


NAMES = ("canary bytes", "violation ring", "write index", "slot_run_counter", "kernel_run_counter")


def assert_same(expected: Side, actual: Side, what: str) -> None:
    for name, want, got in zip(NAMES, expected.arrays(), actual.arrays()):
        if not np.array_equal(want, got):
            if name == "canary bytes":
                slots = np.flatnonzero((want != got).any(axis=1))[:8].tolist()
                raise AssertionError(f"{what}: canary bytes differ at slots {slots}")
            raise AssertionError(f"{what}: {name}: sglang {want.tolist()[:6]} "
                                 f"kvcanary {got.tolist()[:6]}")


class Launches:
    """Runs each launch on SGLang's reference and on kvcanary, and compares. kvcanary runs
    with the scenario's ``extensions`` setting, and with ``extensions=False`` (upstream's
    bytes exactly) on a write whose launch writes one non-padding slot twice: there its
    extensions add ``WRITE_SLOT_CONFLICT`` rows (docs/extensions.md)."""

    def __init__(self, up, torch, canary, ring_capacity, sources, mode, chain_flag, extensions,
                 chain_across=False):
        self.up, self.torch = up, torch
        # kvcanary's seeds chained across requests: a seed an earlier request of the launch
        # writes is that write, as in upstream's reference, which runs requests in order
        self.chain_across = chain_across
        self.sglang = Side(canary, ring_capacity)
        self.kvcanary = Side(canary, ring_capacity)
        self.sources, self.mode, self.extensions = sources, mode, extensions
        self.chain_flag = np.array([chain_flag], np.int32)
        self.t = {id(a): torch.from_numpy(a) for a in self.sglang.arrays()}
        self.t_flag = torch.from_numpy(self.chain_flag.copy())
        self.contexts = {}
        self.launches = 0

    def _up_context(self, tag):
        v, s = self.up.verify, self.sglang
        return v.VerifyOrWriteContext(
            canary_buf=self.t[id(s.canary)], kernel_kind=v.CanaryLaunchTag(tag),
            violation_ring=self.t[id(s.ring)], violation_write_index=self.t[id(s.write_index)],
            slot_run_counter=self.t[id(s.slot_counter)],
            kernel_run_counter=self.t[id(s.kernel_counter)],
            real_kv_sources=tuple(src.upstream for src in self.sources),
            real_kv_hash_mode=self.up.consts.RealKvHashMode(self.mode),
            enable_chain_position_assert=self.t_flag)

    def _context(self, tag, extensions: bool):
        """One context per (tag, extensions), kept: an engine reuses its contexts."""
        key = (tag, extensions)
        if key not in self.contexts:
            side = self.kvcanary
            self.contexts[key] = kc.CanaryContext(
                side.canary, kernel_kind=tag,
                violation_log=kc.ViolationLog(side.ring, side.write_index),
                slot_run_counter=side.slot_counter, kernel_run_counter=side.kernel_counter,
                real_kv_sources=tuple(src.kvcanary for src in self.sources),
                real_kv_hash_mode=self.mode, enable_chain_position_assert=self.chain_flag,
                extensions=extensions, chain_across_requests=self.chain_across)
        return self.contexts[key]

    def verify(self, plan: "Plans", check_token: bool, tag) -> None:
        self.launches += 1
        self.up.verify_ref.launch_canary_verify_kernel_torch_reference(
            context=self._up_context(tag), plan=plan.up_verify,
            check_verify_expected_token=check_token)
        kc.verify(self._context(tag, self.extensions), plan.verify,
                  check_expected_token=check_token)
        assert_same(self.sglang, self.kvcanary, f"launch {self.launches} (verify)")

    def write(self, plan: "Plans", input_ids, positions, out_cache_loc, expected, tag) -> bool:
        """Returns whether the launch writes a non-padding slot twice."""
        self.launches += 1
        t = self.torch.from_numpy
        self.up.write_ref.launch_canary_write_kernel_torch_reference(
            context=self._up_context(tag), plan=plan.up_write, input_ids=t(input_ids),
            positions=t(positions), out_cache_loc=t(out_cache_loc),
            enable_write_input_assert=expected is not None,
            expected_input_tokens=None if expected is None else t(expected[0]),
            expected_input_positions=None if expected is None else t(expected[1]))
        conflict = _nonzero_slot_conflict(plan.write, out_cache_loc, self.num_slots)
        kc.write(self._context(tag, self.extensions and not conflict), plan.write,
                 input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                 expected_input_tokens=None if expected is None else expected[0],
                 expected_input_positions=None if expected is None else expected[1])
        assert_same(self.sglang, self.kvcanary, f"launch {self.launches} (write)")
        return conflict

    @property
    def num_slots(self) -> int:
        return self.sglang.canary.shape[0]

    def corrupt(self, rng) -> None:
        """Change one canary field on every side alike (a bug between launches)."""
        slot = int(rng.integers(1, self.num_slots))
        field = int(rng.integers(0, 4))
        value = int(rng.integers(-2**63, 2**63 - 1, dtype=np.int64))
        for side in (self.sglang, self.kvcanary):
            side.canary.view("<i8")[slot, field] = value


# ------------------------------------------------------------------ real-KV sources


class Source:
    """One real-KV source over shared bytes: SGLang's and kvcanary's views of one tensor
    (any element type, rows possibly wider than their slots, row stride wider still)."""

    DTYPES = ("uint8", "float16", "bfloat16", "int32", "float32")

    def __init__(self, up, torch, rng, num_slots):
        self.page_size = int(rng.choice([1, 1, 2, 4, 16]))
        self.num_bytes_per_token = int(rng.choice([16, 32, 64]))
        self.read_bytes = 16 * int(rng.integers(1, self.num_bytes_per_token // 16 + 1))
        rows = -(-num_slots // self.page_size)
        if rng.random() < 0.06:  # fewer slots than the canary buffer (upstream allows it)
            rows = max(1, rows // 2)
        hole = 16 * int(rng.integers(0, 2))  # trailing row bytes the canary never reads
        gap = 16 * int(rng.integers(0, 3))  # foreign bytes between rows
        row_bytes = self.page_size * self.num_bytes_per_token + hole
        self.backing = rng.integers(0, 256, size=(rows, row_bytes + gap), dtype=np.uint8)
        dtype = getattr(torch, str(rng.choice(self.DTYPES)))
        tensor = torch.from_numpy(self.backing)[:, :row_bytes].view(dtype)
        layout = dict(page_size=self.page_size, num_bytes_per_token=self.num_bytes_per_token,
                      read_bytes=self.read_bytes)
        self.upstream = up.verify.RealKvSource(tensor=tensor, **layout)
        self.kvcanary = kc.RealKvSource(tensor, **layout)
        self.num_slots = rows * self.page_size

    def flip(self, rng) -> None:
        """Change one real KV byte (both sides read these bytes)."""
        row = int(rng.integers(0, self.backing.shape[0]))
        self.backing[row, int(rng.integers(0, self.backing.shape[1]))] ^= 0x5A


# ------------------------------------------------------------------ plans


class Plans:
    """A VerifyPlan and WritePlan per side, starting from the same contents and reused
    from step to step (stale entries past this step's count are compared too)."""

    def __init__(self, up, torch, verify_capacity, write_capacity):
        self.verify = kc.VerifyPlan.allocate(verify_capacity)
        self.write = kc.WritePlan.allocate(write_capacity)
        t = lambda a: torch.from_numpy(a.copy())  # noqa: E731
        self.up_verify = up.verify.VerifyPlan(
            **{name: t(getattr(self.verify, name)) for name in kc.VerifyPlan.ARRAYS})
        self.up_write = up.write.WritePlan(
            **{name: t(getattr(self.write, name)) for name in kc.WritePlan.ARRAYS})

    def assert_same(self, what) -> None:
        for mine, theirs in ((self.verify, self.up_verify), (self.write, self.up_write)):
            for name in mine.ARRAYS:
                want, got = getattr(theirs, name).numpy(), getattr(mine, name)
                if not np.array_equal(want, got):
                    raise AssertionError(f"{what}: plan.{name}: sglang {want.tolist()[:12]} "
                                         f"kvcanary {got.tolist()[:12]}")


# ------------------------------------------------------------------ inputs-only classification


def _hashing(launches) -> bool:
    return launches.mode != kc.RealKvHashMode.NONE and bool(launches.sources)


def _check_slots(launches, slots) -> None:
    """SetAside when any of ``slots`` (the slots upstream reads) is outside the buffer or,
    with hashing on, outside a real-KV source."""
    slots = np.asarray(slots, np.int64)
    if ((slots < 0) | (slots >= launches.num_slots)).any():
        raise SetAside(OUT_OF_RANGE)
    if _hashing(launches) and any((slots >= s.num_slots).any() for s in launches.sources):
        raise SetAside(OUTSIDE_SOURCE)


def classify_verify(launches, plan: kc.VerifyPlan) -> None:
    if int(plan.enable[0]) == 0:
        return
    active = max(0, min(int(plan.verify_num_valid[0]), plan.verify_capacity))
    slots = plan.verify_slot_indices[:active]
    prevs = plan.verify_prev_slot_indices[:active][slots != 0]
    if (prevs >= launches.num_slots).any() or (slots < 0).any():
        raise SetAside(OUT_OF_RANGE)
    _check_slots(launches, slots[slots != 0])


def _spans(plan: kc.WritePlan):
    """(request, start, end) of every request the write visits, and the total entries."""
    active = max(0, min(int(plan.write_num_valid_reqs[0]), plan.write_req_capacity))
    total = int(plan.write_offsets[active]) if active else 0
    if total <= 0:
        return [], 0
    return [(r, int(plan.write_offsets[r]), int(plan.write_offsets[r + 1]))
            for r in range(active) if plan.write_offsets[r + 1] > plan.write_offsets[r]], total


def classify_write(launches, plan: kc.WritePlan, out_cache_loc) -> bool:
    """Sets the launch aside or returns whether a seed is written earlier in the launch
    (compared where the context chains seeds across requests)."""
    spans, total = _spans(plan)
    seeds = plan.write_seed_slot_indices
    if any(int(seeds[r]) >= launches.num_slots for r, _, _ in spans):
        raise SetAside(OUT_OF_RANGE)
    if _hashing(launches):  # upstream gathers the rows of every slot up to the total
        _check_slots(launches, out_cache_loc[:total][out_cache_loc[:total] >= 0])
    written, chained = set(), False
    for r, start, end in spans:
        seed = int(seeds[r])
        if seed >= 0 and seed in written:
            if not launches.chain_across:
                raise SetAside(SEED_ORDER)
            chained = True
        slots = out_cache_loc[start:end]
        _check_slots(launches, slots[slots >= 0])
        written.update(int(s) for s in slots[slots >= 0])
    return chained


def _nonzero_slot_conflict(plan, out_cache_loc, num_slots) -> bool:
    slots = [int(s) for _, start, end in _spans(plan)[0] for s in out_cache_loc[start:end]
             if 0 < s < num_slots]
    return len(slots) != len(set(slots))


# ------------------------------------------------------------------ an engine's steps


class Engine:
    """A tiny serving engine: request rows of ``req_to_token``, a slot allocator (slot 0 is
    the padding slot), token histories, prefix sharing, optionally an SWA pool reached
    through ``full_to_swa_index_mapping``; each step builds one batch."""

    def __init__(self, rng, num_slots):
        self.rng = rng
        self.max_reqs = int(rng.integers(3, 7))
        self.max_len = int(rng.integers(8, 24))
        self.table = np.zeros((self.max_reqs, self.max_len),
                              np.int32 if rng.random() < 0.8 else np.int64)
        self.lengths = np.zeros(self.max_reqs, np.int64)
        self.history = np.zeros((self.max_reqs, self.max_len + 2), np.int32)
        self.swa = rng.random() < 0.3
        self.window = int(rng.integers(1, 8)) if self.swa else 0
        if self.swa:  # full slots are ids of a bigger pool; the LUT maps them to canary
            # slots, and a few to 0 (an SWA slot already freed)
            full_pool = 2 * num_slots
            mapped = rng.choice(np.arange(1, full_pool), size=num_slots - 1, replace=False)
            self.lut = np.zeros(full_pool, np.int64)
            self.lut[mapped] = rng.permutation(np.arange(1, num_slots))
            unmapped = np.setdiff1d(np.arange(1, full_pool), mapped)[:2]
            self.free = list(rng.permutation(np.concatenate([mapped, unmapped])))
        else:
            self.lut = None
            self.free = list(rng.permutation(np.arange(1, num_slots)))

    def keep_below(self, limit: int) -> None:
        """Allocate only slots (canary slots, after the LUT) below ``limit``."""
        canary_slot = (lambda f: self.lut[f]) if self.lut is not None else (lambda f: f)
        self.free = [f for f in self.free if canary_slot(f) < limit]

    def allocate(self, count):
        if self.rng.random() < 0.02 and self.table.any():  # double allocation (a bug)
            used = self.table[self.table > 0]
            return list(self.rng.choice(used, size=count))
        if len(self.free) < count:
            return None
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def token(self):
        roll = self.rng.random()
        if roll < 0.03:
            return -1
        if roll < 0.06:
            return int(self.rng.choice([0, 0x7FFFFFFF, -(2**31)]))
        return int(self.rng.integers(0, 2**31 - 1))

    def step(self):
        """One batch: rows of (row, prefix, extend) with new slots and tokens in place."""
        rows = []
        committed = self.lengths.copy()  # a prefix is shared once its KV is written
        candidates = list(self.rng.permutation(np.arange(1, self.max_reqs)))
        for rp in candidates[: int(self.rng.integers(1, len(candidates) + 1))]:
            rp = int(rp)
            prefix = int(self.lengths[rp])
            if prefix == 0 and self.rng.random() < 0.3:  # share another request's prefix
                donors = [d for d in range(1, self.max_reqs) if d != rp and committed[d] > 1]
                if donors:
                    donor = int(self.rng.choice(donors))
                    shared = int(self.rng.integers(1, committed[donor]))
                    self.table[rp, :shared] = self.table[donor, :shared]
                    self.history[rp, :shared] = self.history[donor, :shared]
                    prefix = shared
            room = self.max_len - prefix
            if room <= 0:
                continue
            extend = min(room, 1 if prefix and self.rng.random() < 0.6
                         else int(self.rng.integers(0, 6)))
            slots = self.allocate(extend)
            if slots is None:
                continue
            self.table[rp, prefix:prefix + extend] = slots
            for j in range(extend):
                self.history[rp, prefix + j] = np.int32(self.token())
            self.lengths[rp] = prefix + extend
            rows.append((rp, prefix, extend))
        for _ in range(int(self.rng.integers(0, 3))):  # CUDA-graph padding rows
            rows.insert(int(self.rng.integers(0, len(rows) + 1)),
                        (0, int(self.rng.integers(0, 10**6)), int(self.rng.integers(0, 3))))
        return rows

    def write_inputs(self, rows):
        """input_ids, positions and out_cache_loc of the active rows' new tokens, with
        padding writes to slot 0, skipped (-1) entries and an occasional wrong position."""
        ids, positions, slots = [], [], []
        for rp, prefix, extend in rows:
            if rp == 0:
                continue
            for j in range(extend):
                ids.append(int(self.history[rp, prefix + j]))
                positions.append(prefix + j)
                slot = int(self.table[rp, prefix + j])
                slots.append(int(self.lut[slot]) if self.lut is not None else slot)
        ids, positions, slots = (np.array(a, np.int64) for a in (ids, positions, slots))
        for array, value, p in ((slots, 0, 0.1), (slots, -1, 0.05), (positions, None, 0.05)):
            hit = self.rng.random(array.shape[0]) < p
            if value is None:
                array[hit] += self.rng.integers(-2, 3, size=int(hit.sum()))
            else:
                array[hit] = value
        return ids, positions, slots


# ------------------------------------------------------------------ one scenario


def _plan(up, engine, plans, rows, pool, offset, lut):
    """The plan on both sides; returns an error text when both refuse it (compared)."""
    rpi = np.array([r[0] for r in rows], np.int64)
    prefix = np.array([r[1] for r in rows], np.int64)
    extend = np.array([r[2] for r in rows], np.int64)
    valid = None
    if pool is not None:
        valid = np.array([engine.lengths[r] + int(engine.rng.integers(-2, 3)) if r else 0
                          for r in rpi], np.int64)
    torch = up.torch
    t = lambda a: None if a is None else torch.from_numpy(a)  # noqa: E731
    errors = []
    for run in (
        lambda: up.plan_ref.launch_canary_plan_kernels_torch_reference(
            verify_plan_out=plans.up_verify, write_plan_out=plans.up_write,
            req_pool_indices=t(rpi), prefix_lens=t(prefix), extend_seq_lens=t(extend),
            req_to_token=t(engine.table), swa_window_size=engine.window,
            full_to_swa_index_mapping=t(lut), verify_capacity=plans.verify.verify_capacity,
            req_to_verify_expected_tokens=t(pool),
            req_to_verify_expected_tokens_valid_lens=t(valid),
            kv_token_id_vs_position_offset=offset),
        lambda: kc.plan(
            req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend,
            req_to_token=engine.table, verify_plan=plans.verify, write_plan=plans.write,
            swa_window_size=engine.window, full_to_swa_index_mapping=lut,
            req_to_verify_expected_tokens=pool, req_to_verify_expected_tokens_valid_lens=valid,
            kv_token_id_vs_position_offset=offset, backend="numpy"),
    ):
        try:
            run()
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    assert errors[0] == errors[1], f"plan errors differ: sglang {errors[0]!r} kvcanary {errors[1]!r}"
    return errors[0]


def run_scenario(up, seed: int, stats) -> None:
    rng = np.random.default_rng(seed)
    torch = up.torch
    num_slots = int(rng.integers(12, 64))
    stride = int(rng.choice([32, 32, 40, 48, 64]))
    canary = np.zeros((num_slots, stride), np.uint8)
    canary[:, 32:] = rng.integers(0, 256, size=(num_slots, stride - 32), dtype=np.uint8)
    mode = kc.RealKvHashMode(int(rng.choice([0, 1, 2])))
    sources = [Source(up, torch, rng, num_slots) for _ in range(int(rng.choice([0, 1, 1, 2, 4])))]
    engine = Engine(rng, num_slots)
    launches = Launches(up, torch, canary, int(rng.choice([1, 2, 4, 64])), sources, mode,
                        int(rng.integers(0, 2)), extensions=rng.random() < 0.7,
                        chain_across=seed % 2 == 1)   # from the seed: the draws stay as they were
    smallest = min([s.num_slots for s in sources], default=num_slots)
    small_sources = smallest < num_slots and mode != kc.RealKvHashMode.NONE
    if smallest < num_slots and rng.random() < 0.7:
        engine.keep_below(smallest)  # every slot written or verified lies inside the sources
    pool_on = rng.random() < 0.5
    offset = int(rng.choice([0, 0, 1]))  # +1: an EAGLE draft pool
    lut = engine.lut
    if lut is not None and rng.random() < 0.15:  # a mapping shorter than the pool
        lut = lut[: int(rng.integers(1, lut.shape[0]))]
    # Capacity edges: a batch holds up to max_reqs - 1 requests and 2 padding rows, and
    # a step's verify entries may fit exactly, or overflow (enable = 0).
    write_capacity = engine.max_reqs + 1 + int(rng.choice([0, 0, 2]))
    need = engine.max_reqs * (engine.window or engine.max_len)
    verify_capacity = int(rng.choice([need + 8, rng.integers(1, need + 1)]))
    plans = Plans(up, torch, verify_capacity, write_capacity)
    try:
        for step in range(int(rng.integers(2, 5))):
            rows = engine.step()
            if not rows:
                continue
            pool = engine.history if pool_on else None
            error = _plan(up, engine, plans, rows, pool, offset, lut)
            plans.assert_same(f"seed {seed} step {step} plan")
            if error is not None:
                stats[REFUSED] += 1
                return
            check_token = pool is not None
            head, tail = (int(rng.integers(0, NUM_TAGS)) for _ in range(2))
            classify_verify(launches, plans.verify)
            launches.verify(plans, check_token, head)
            ids, positions, out_cache_loc = engine.write_inputs(rows)
            expected = None
            if rng.random() < 0.3:
                expected = (ids.copy(), positions.copy())
                wrong = rng.random(ids.shape[0]) < 0.1
                expected[int(rng.integers(0, 2))][wrong] += 1
            stats[CHAINED] += classify_write(launches, plans.write, out_cache_loc)
            if launches.write(plans, ids, positions, out_cache_loc, expected, tail):
                stats[CONFLICT] += 1
            if rng.random() < 0.2:
                launches.corrupt(rng)
            if sources and rng.random() < 0.2:
                sources[int(rng.integers(0, len(sources)))].flip(rng)
            launches.verify(plans, check_token, tail)
    except SetAside as reason:
        stats[str(reason)] += 1
        return
    finally:
        stats["launches compared"] += launches.launches
    stats["scenarios compared to the end"] += 1
    stats[SMALL_SOURCES] += small_sources


def run_scenarios(upstream, seeds) -> collections.Counter:
    stats = collections.Counter()
    for seed in seeds:
        try:
            run_scenario(upstream, seed, stats)
        except AssertionError as exc:
            raise AssertionError(f"scenario seed {seed}: {exc}") from None
    return stats


# The random scenarios undersize some verify plans on purpose (upstream disables the launch).
@pytest.mark.filterwarnings("ignore::kvcanary.VerifyPlanTooSmall")
def test_kvcanary_matches_sglangs_reference_on_random_engine_scenarios(upstream):
    start = time.perf_counter()
    stats = run_scenarios(upstream, range(SCENARIOS))
    elapsed = time.perf_counter() - start
    set_aside = {k: v for k, v in stats.items() if k not in COMPARED}
    print(f"\nSGLang {sglang_oracle.version()} oracle: {SCENARIOS} scenarios in {elapsed:.1f} s, "
          f"{stats['scenarios compared to the end']} compared to the end "
          f"({stats[SMALL_SOURCES]} {SMALL_SOURCES}), "
          f"{stats['launches compared']} launches compared, {stats[REFUSED]} {REFUSED}, "
          f"{stats[CONFLICT]} {CONFLICT}, {stats[CHAINED]} launches {CHAINED}; set aside: "
          + ", ".join(f"{v} {k}" for k, v in sorted(set_aside.items())))
    assert stats["launches compared"] >= 5 * SCENARIOS
    assert stats[CHAINED] > 0


@pytest.mark.filterwarnings("ignore::kvcanary.VerifyPlanTooSmall")
def test_the_cpu_kernels_match_sglangs_reference_too(upstream, kernels_behind_numpy):  # noqa: F811
    """A slice of the scenarios with kvcanary's numpy dispatch running the CUDA kernel
    source compiled for the CPU beside the reference (every thread order, bytes compared
    after each launch), so the kernels meet SGLang's reference as well."""
    stats = run_scenarios(upstream, range(SCENARIOS, SCENARIOS + KERNEL_SCENARIOS))
    assert_compared(kernels_behind_numpy)
    assert stats["launches compared"] >= 5 * KERNEL_SCENARIOS
    assert kernels_behind_numpy.compared >= stats["launches compared"]  # plans come on top


# ------------------------------------------------------------------ obtaining the oracle


def test_a_cached_version_is_used_without_pip(tmp_path, monkeypatch):
    cached = tmp_path / "9.9.9" / sglang_oracle.PACKAGE
    cached.mkdir(parents=True)
    (cached / "write_ref.py").write_text("")
    monkeypatch.setenv(sglang_oracle.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(sglang_oracle.subprocess, "run",
                        lambda *a, **k: pytest.fail("pip ran although the version is cached"))
    assert sglang_oracle.obtain("9.9.9") == tmp_path / "9.9.9"


def test_a_version_pip_cannot_get_is_unavailable_with_pips_reason(tmp_path, monkeypatch):
    monkeypatch.setenv(sglang_oracle.CACHE_ENV, str(tmp_path))
    with pytest.raises(sglang_oracle.Unavailable, match=r"pip download sglang==0\.0\.0\.dev1 "):
        sglang_oracle.obtain("0.0.0.dev1")
    assert not (tmp_path / "0.0.0.dev1").exists()  # nothing half-cached


def test_without_torch_the_oracle_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(sglang_oracle.Unavailable, match="torch is not installed"):
        sglang_oracle.oracle()


def test_the_readme_names_the_version_and_scenario_count_checked():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert f"SGLang {sglang_oracle.DEFAULT_VERSION}'s published" in readme
    assert f"sglang=={sglang_oracle.DEFAULT_VERSION}" in readme
    assert f"on {SCENARIOS:,} seeded engine scenarios" in readme
