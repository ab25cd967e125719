"""GPU smoke test behind ``kvcanary smoke``: compile the kernels for a source-count bound,
run a synthetic serving step (prefill, then decode) with that many real-KV sources on the
device and with the numpy reference, compare every byte, then inject one fault of each
kind and check the device reports it exactly like the reference.

``run_smoke`` returns a :class:`SmokeReport`; it raises ``CudaUnavailable`` when cupy or a
device is missing. The device side is pluggable (``xp``/``device``) so the same logic can
be exercised on the CPU-compiled kernels in the test suite."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np

from ..api import launches as api
from ..format.consts import FailReason, LaunchTag, RealKvHashMode
from ..model.types import (CanaryContext, RealKvSource, VerifyPlan, ViolationLog, WritePlan,
                    check_source_bound)

NUM_SLOTS = 8192
BATCH = 8
PREFILL = 384
BYTES_PER_TOKEN = 64
RING = 256


@dataclass
class SmokeReport:
    max_real_kv_sources: int
    checks: list = field(default_factory=list)     # (name, ok, detail)
    timings: list = field(default_factory=list)    # (name, seconds)

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.checks)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, bool(ok), detail))

    def lines(self) -> list[str]:
        out = [f"kvcanary smoke: {self.max_real_kv_sources} real-KV sources"]
        out += [f"  {'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}"
                for name, ok, detail in self.checks]
        out += [f"  time {name}: {seconds * 1e3:.3f} ms" for name, seconds in self.timings]
        out.append("smoke: " + ("passed" if self.ok else "FAILED"))
        return out


class _World:
    """One canary world (buffer, log, counters, sources, tables) on one array library."""

    def __init__(self, xp, host: dict, bound: int):
        self.xp = xp
        put = (lambda a: a.copy()) if xp is np else xp.asarray
        self.host = host
        self.sources = [RealKvSource(put(t), page_size=1, num_bytes_per_token=BYTES_PER_TOKEN,
                                     read_bytes=BYTES_PER_TOKEN) for t in host["sources"]]
        self.ctx = CanaryContext(
            put(np.zeros((NUM_SLOTS, 32), np.uint8)), kernel_kind=LaunchTag.TAIL_K_FULL,
            violation_log=ViolationLog(put(np.zeros((RING, 8), np.int64)),
                                       put(np.zeros(1, np.int32))),
            slot_run_counter=put(np.zeros(1, np.int64)),
            kernel_run_counter=put(np.zeros(1, np.int64)), real_kv_sources=self.sources,
            real_kv_hash_mode=RealKvHashMode.ALL,
            enable_chain_position_assert=put(np.ones(1, np.int32)), max_real_kv_sources=bound)
        self.put = put
        self.table = put(host["table"])
        self.pool = put(host["pool"])
        self.verify_plan = VerifyPlan(*(put(a) for a in _empty_verify(BATCH * (PREFILL + 2))))
        self.write_plan = WritePlan(*(put(a) for a in _empty_write(BATCH)))

    def plan(self, run, prefix, extend, valid):
        put = self.put
        run.plan(req_pool_indices=put(self.host["rows"]), prefix_lens=put(prefix),
                 extend_seq_lens=put(extend), req_to_token=self.table,
                 verify_plan=self.verify_plan, write_plan=self.write_plan,
                 req_to_verify_expected_tokens=self.pool,
                 req_to_verify_expected_tokens_valid_lens=put(valid))

    def write(self, run, tokens, positions, slots):
        put = self.put
        run.write(self.ctx, self.write_plan, input_ids=put(tokens), positions=put(positions),
                  out_cache_loc=put(slots), expected_input_tokens=put(tokens),
                  expected_input_positions=put(positions))

    def verify(self, run):
        run.verify(self.ctx, self.verify_plan, check_expected_token=True)

    def state(self) -> dict:
        get = (lambda a: np.asarray(a)) if self.xp is np else (lambda a: a.get())
        log = self.ctx.violation_log
        rows = get(log.ring)[: max(0, min(int(get(log.write_index)[0]), RING))]
        return {
            "canary": get(self.ctx.canary_buf), "write_index": get(log.write_index),
            "slot_run_counter": get(self.ctx.slot_run_counter),
            "kernel_run_counter": get(self.ctx.kernel_run_counter),
            "rows": sorted(tuple(int(v) for v in r) for r in rows),
            **{k: get(v) for k, v in self.verify_plan.arrays().items()},
            **{k: get(v) for k, v in self.write_plan.arrays().items()},
        }


def _empty_verify(capacity):
    return (np.zeros(capacity, np.int64), np.full(capacity, -1, np.int64),
            np.zeros(capacity, np.int64), np.zeros(capacity, np.int64),
            np.zeros(1, np.int32), np.ones(1, np.int32))


def _empty_write(capacity):
    return (np.zeros(capacity + 1, np.int64), np.full(capacity, -1, np.int64),
            np.zeros(1, np.int32))


def synthetic_batch(bound: int, seed: int = 0) -> dict:
    """Tables and token streams of BATCH requests with PREFILL + 1 tokens each, on
    disjoint random slots (slot 0 stays padding), and ``bound`` random sources."""
    rng = np.random.default_rng(seed)
    length = PREFILL + 1
    rows = np.arange(1, BATCH + 1, dtype=np.int64)
    slots = rng.permutation(np.arange(1, NUM_SLOTS))[: BATCH * length].reshape(BATCH, length)
    table = np.zeros((BATCH + 1, length + 1), np.int32)
    table[1:, :length] = slots
    tokens = rng.integers(0, 50_000, size=(BATCH, length)).astype(np.int64)
    pool = np.zeros((BATCH + 1, length + 1), np.int32)
    pool[1:, :length] = tokens
    sources = [rng.integers(0, 256, size=(NUM_SLOTS, BYTES_PER_TOKEN), dtype=np.uint8)
               for _ in range(bound)]
    return dict(rows=rows, slots=slots, table=table, tokens=tokens, pool=pool, sources=sources)


def _step_inputs(host, begin, end):
    tokens = host["tokens"][:, begin:end].reshape(-1)
    positions = np.tile(np.arange(begin, end, dtype=np.int64), BATCH)
    slots = host["slots"][:, begin:end].reshape(-1).astype(np.int64)
    return tokens, positions, slots


def _compare(report, name, expected: dict, actual: dict) -> bool:
    bad = [k for k in expected if not (np.array_equal(expected[k], actual[k])
                                       if isinstance(expected[k], np.ndarray)
                                       else expected[k] == actual[k])]
    report.check(name, not bad, "bytes equal" if not bad else "differs in " + ", ".join(bad))
    return not bad


class _Api:
    """kvcanary's public API (dispatch by array type)."""

    plan = staticmethod(api.plan)
    write = staticmethod(api.write)
    verify = staticmethod(api.verify)


def _timed(report, name, fn, sync):
    sync()
    start = time.perf_counter()
    fn()
    sync()
    report.timings.append((name, time.perf_counter() - start))


FAULTS = ("token", "position", "prev_hash", "real_kv_byte", "out_of_range_slot")


def run_smoke(max_real_kv_sources: int = 4, *, xp=None, device=None, seed: int = 0) -> SmokeReport:
    """Run the smoke test; ``xp``/``device`` default to cupy and kvcanary's API."""
    bound = check_source_bound(max_real_kv_sources)
    report = SmokeReport(bound)
    sync = lambda: None  # noqa: E731
    if xp is None:
        from ..backends.cuda import compile_kernels, require_cupy

        xp = require_cupy()
        sync = xp.cuda.Device().synchronize
        for variant, seconds in compile_kernels(bound):
            report.timings.append((f"compile {variant}", seconds))
    device = device or _Api()
    host = synthetic_batch(bound, seed)
    ref, dev = _World(np, host, bound), _World(xp, host, bound)

    # Step 1: prefill PREFILL tokens per request; step 2: verify them and decode one more.
    zeros, prefill = np.zeros(BATCH, np.int64), np.full(BATCH, PREFILL, np.int64)
    ones, full = np.ones(BATCH, np.int64), np.full(BATCH, PREFILL + 1, np.int64)
    steps = [(zeros, prefill, _step_inputs(host, 0, PREFILL)),
             (prefill, ones, _step_inputs(host, PREFILL, PREFILL + 1))]
    for index, (prefix, extend, inputs) in enumerate(steps):
        label = "prefill" if index == 0 else "decode"
        for world, run, tag in ((ref, _Api(), "numpy"), (dev, device, "device")):
            _timed(report, f"{tag} plan ({label})", lambda: world.plan(run, prefix, extend, full), sync)
            _timed(report, f"{tag} verify ({label})", lambda: world.verify(run), sync)
            _timed(report, f"{tag} write ({label})", lambda: world.write(run, *inputs), sync)
        if not _compare(report, f"{label} step matches the reference", ref.state(), dev.state()):
            return report
    report.check("clean run records no violation", not ref.state()["rows"],
                 f"{len(ref.state()['rows'])} rows")

    # Faults: each on its own copy of the clean state, then plan + verify of the full prefix.
    victim = int(host["slots"][2, 100])  # request row 3, position 100
    for fault in FAULTS:
        worlds = []
        for world in (ref, dev):
            twin = copy.copy(world)
            twin.ctx = copy.copy(world.ctx)
            twin.ctx.canary_buf = world.ctx.canary_buf.copy()
            twin.ctx.violation_log = ViolationLog(world.ctx.violation_log.ring.copy(),
                                                  world.ctx.violation_log.write_index.copy())
            twin.ctx.violation_log.clear()
            twin.table = world.table.copy()
            twin.sources = [RealKvSource(s.tensor.copy(), page_size=1,
                                         num_bytes_per_token=BYTES_PER_TOKEN,
                                         read_bytes=BYTES_PER_TOKEN) for s in world.sources]
            twin.ctx.real_kv_sources = tuple(twin.sources)
            fields = twin.ctx.canary_buf.view(twin.xp.int64)
            if fault == "token":
                fields[victim, 0] += 1
            elif fault == "position":
                fields[victim, 1] += 3
            elif fault == "prev_hash":
                fields[victim, 2] ^= 0x40
            elif fault == "real_kv_byte":
                twin.sources[-1].tensor[victim, 5] ^= 0x08
            else:
                twin.table[3, 50] = NUM_SLOTS + 5
            worlds.append(twin)
        for twin, run in zip(worlds, (_Api(), device)):
            twin.plan(run, full, np.zeros(BATCH, np.int64), full)
            twin.verify(run)
            sync()
        expected, actual = worlds[0].state(), worlds[1].state()
        same = _compare(report, f"fault {fault}: device matches the reference", expected, actual)
        wanted = {
            "token": (victim, FailReason.VERIFY_TOKEN_MISMATCH),
            "position": (victim, FailReason.VERIFY_POSITION_MISMATCH),
            "prev_hash": (victim, FailReason.VERIFY_CHAIN_HASH_MISMATCH),
            "real_kv_byte": (victim, FailReason.VERIFY_REAL_KV_HASH_MISMATCH),
            "out_of_range_slot": (NUM_SLOTS + 5, FailReason.SLOT_OUT_OF_RANGE),
        }[fault]
        found = any(row[1] == wanted[0] and row[7] & int(wanted[1]) for row in actual["rows"])
        report.check(f"fault {fault}: reported", same and found,
                     f"{wanted[1].name} at slot {wanted[0]}" + ("" if found else " missing"))
    return report
