"""A tiny serving simulation: requests with shared prefixes, paged slot allocation,
chunked prefill then decode, driven through kc.plan -> kc.verify -> kc.write.

Used by the property tests (and reusable for kernel tests): ``run_workload`` returns the
context and the final full-prefix VerifyPlan of a clean run."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import kvcanary as kc
from builders import i64, make_context, make_sources


@dataclass
class Request:
    prompt_len: int
    decode_len: int
    chunk: int
    share: int = 0  # leading tokens shared with request 0 (a cached radix prefix)

    @property
    def total(self) -> int:
        return self.prompt_len + self.decode_len


@dataclass
class Workload:
    requests: list
    page_size: int = 1
    num_sources: int = 0
    mode: kc.RealKvHashMode = kc.RealKvHashMode.NONE
    bytes_per_token: int = 16
    read_bytes: int = 16
    row_gap: int = 0
    seed: int = 0
    swa_window: int = 0  # > 0: an SWA group, slots translated through a permuting LUT


@dataclass
class Run:
    ctx: kc.CanaryContext
    table: np.ndarray
    tokens: np.ndarray  # expected-token pool, int32 [max_reqs, max_len]
    lengths: list
    final_plan: kc.VerifyPlan = None
    lut: np.ndarray = None
    steps: int = 0
    dirty: list = field(default_factory=list)  # (step, launch) of any violation


def _allocate_slots(workload: Workload, rng):
    """Per request row, the slot of every position; shared prefixes reuse request 0's."""
    ps = workload.page_size
    reqs = workload.requests
    max_len = max(r.total for r in reqs)
    table = np.zeros((len(reqs) + 1, max_len), dtype=np.int32)
    need = sum(r.total - r.share for r in reqs)
    pages = -(-need // ps) + len(reqs) + 1
    order = rng.permutation(np.arange(1, pages))  # page 0 holds padding slot 0
    next_page = 0
    for row, req in enumerate(reqs, start=1):
        own = []
        while len(own) < req.total - req.share:
            page = int(order[next_page])
            next_page += 1
            own.extend(range(page * ps, page * ps + ps))
        table[row, req.share:req.total] = own[:req.total - req.share]
        if req.share:
            table[row, :req.share] = table[1, :req.share]
    return table, pages * ps


def run_workload(workload: Workload, *, check_steps: bool = True) -> Run:
    rng = np.random.default_rng(workload.seed)
    reqs = workload.requests
    table, num_slots = _allocate_slots(workload, rng)
    tokens = rng.integers(-2, 50_000, size=table.shape).astype(np.int32)
    tokens[0] = 0
    for row, req in enumerate(reqs, start=1):
        tokens[row, :req.share] = tokens[1, :req.share]
    sources = make_sources(workload.num_sources, num_slots,
                           bytes_per_token=workload.bytes_per_token,
                           read_bytes=workload.read_bytes, page_size=workload.page_size,
                           row_gap=workload.row_gap, fill="random", seed=workload.seed)
    ctx = make_context(num_slots, 256, sources, workload.mode,
                       kernel_kind=kc.LaunchTag.TAIL_K_FULL)
    run = Run(ctx, table, tokens, [r.total for r in reqs])
    swa = {}
    lut = np.arange(num_slots, dtype=np.int64)
    if workload.swa_window > 0:
        lut[1:] = 1 + rng.permutation(num_slots - 1)  # slot 0 stays padding
        swa = dict(swa_window_size=workload.swa_window, full_to_swa_index_mapping=lut)
    run.lut = lut
    done = [r.share for r in reqs]
    verify_plan = kc.VerifyPlan.allocate(max(1, sum(run.lengths)))
    write_plan = kc.WritePlan.allocate(len(reqs) + 1)
    while any(d < r.total for d, r in zip(done, reqs)):
        rows, prefix, extend = [], [], []
        for i, req in enumerate(reqs):
            if done[i] >= req.total or (req.share and done[0] < req.share):
                continue
            step = min(req.chunk, req.prompt_len - done[i]) if done[i] < req.prompt_len else 1
            rows.append(i + 1)
            prefix.append(done[i])
            extend.append(step)
        rows.append(0)  # a CUDA-graph padding row: contributes nothing
        prefix.append(int(rng.integers(0, 5)))
        extend.append(0)
        bs = len(rows)
        kc.plan(req_pool_indices=i64(rows), prefix_lens=i64(prefix), extend_seq_lens=i64(extend),
                req_to_token=table, verify_plan=verify_plan, write_plan=write_plan, **swa,
                req_to_verify_expected_tokens=tokens,
                req_to_verify_expected_tokens_valid_lens=i64(
                    [done[r - 1] if r else 0 for r in rows]))
        _launch(run, "verify", lambda: kc.verify(ctx, verify_plan, check_expected_token=True))
        index = [(r, p) for r, p0, e in zip(rows, prefix, extend) if r
                 for p in range(p0, p0 + e)]
        ids = i64([tokens[r, p] for r, p in index])
        positions = i64([p for _, p in index])
        loc = i64([lut[table[r, p]] for r, p in index])
        _launch(run, "write", lambda: kc.write(
            ctx, write_plan, input_ids=ids, positions=positions, out_cache_loc=loc,
            expected_input_tokens=ids.copy(), expected_input_positions=positions.copy()))
        for r, e in zip(rows[:bs - 1], extend[:bs - 1]):
            done[r - 1] += e
        run.steps += 1
    final = kc.VerifyPlan.allocate(max(1, sum(run.lengths)))
    kc.plan(req_pool_indices=i64(range(1, len(reqs) + 1)), prefix_lens=i64(run.lengths),
            extend_seq_lens=i64([0] * len(reqs)), req_to_token=table, verify_plan=final,
            write_plan=kc.WritePlan.allocate(len(reqs)), **swa,
            req_to_verify_expected_tokens=tokens,
            req_to_verify_expected_tokens_valid_lens=i64(run.lengths))
    run.final_plan = final
    _launch(run, "final verify", lambda: kc.verify(ctx, final, check_expected_token=True))
    return run


def _launch(run: Run, name: str, call) -> None:
    before = int(run.ctx.violation_log.write_index[0])
    call()
    if int(run.ctx.violation_log.write_index[0]) != before:
        run.dirty.append((run.steps, name))
