"""A torch engine's use of the CUDA path, as the README describes it (GPU and torch only):

* launches on torch's stream through ``cupy.cuda.ExternalStream`` are ordered after the
  KV writes torch queued on that stream;
* plan -> verify -> write captured once in a CUDA graph (torch's ``torch.cuda.graph`` and
  CuPy's stream capture) and replayed for several decode steps, with the inputs updated
  in place between replays, leave the bytes the numpy reference leaves after the same
  steps (a slot corrupted midway included)."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from builders import linear_req_to_token
from kernel_harness.gpu import require_gpu

pytestmark = pytest.mark.gpu

REQUESTS, LENGTH, PREFILL, STEPS = 4, 64, 8, 6
CORRUPT_AT_STEP, CORRUPT_SLOT = 3, 1 * LENGTH + 2  # request row 1, position 2


@pytest.fixture(scope="module")
def torch_cupy():
    cupy = require_gpu()
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch, cupy


class Engine:
    """One engine's canary state and its persistent decode-step inputs, on numpy or cupy."""

    def __init__(self, xp):
        self.xp = xp
        self.table = xp.asarray(linear_req_to_token(REQUESTS + 1, LENGTH, np.int64))
        self.rows = xp.arange(1, REQUESTS + 1, dtype=xp.int64)
        self.context = kc.CanaryContext(
            xp.zeros(((REQUESTS + 1) * LENGTH, 32), dtype=xp.uint8),
            kernel_kind=kc.LaunchTag.HEAD_K_FULL,
            violation_log=kc.ViolationLog.allocate(256, xp=xp),
            slot_run_counter=xp.zeros(1, dtype=xp.int64),
            kernel_run_counter=xp.zeros(1, dtype=xp.int64))
        self.verify_plan = kc.VerifyPlan.allocate(REQUESTS * (PREFILL + STEPS), xp=xp)
        self.write_plan = kc.WritePlan.allocate(REQUESTS, xp=xp)
        self.prefix_lens = xp.zeros(REQUESTS, dtype=xp.int64)
        self.extend_seq_lens = xp.ones(REQUESTS, dtype=xp.int64)
        self.input_ids = xp.zeros(REQUESTS, dtype=xp.int64)
        self.positions = xp.zeros(REQUESTS, dtype=xp.int64)
        self.out_cache_loc = xp.zeros(REQUESTS, dtype=xp.int64)

    def prefill(self) -> None:
        xp = self.xp
        kc.plan(req_pool_indices=self.rows, prefix_lens=xp.zeros(REQUESTS, dtype=xp.int64),
                extend_seq_lens=xp.full(REQUESTS, PREFILL, dtype=xp.int64),
                req_to_token=self.table, verify_plan=self.verify_plan, write_plan=self.write_plan)
        kc.write(self.context, self.write_plan,
                 input_ids=xp.arange(REQUESTS * PREFILL, dtype=xp.int64) % 977,
                 positions=xp.tile(xp.arange(PREFILL, dtype=xp.int64), REQUESTS),
                 out_cache_loc=self.table[1:, :PREFILL].reshape(-1).copy())

    def set_step(self, step: int) -> None:
        """The inputs of decode step ``step``, written in place."""
        xp = self.xp
        prefix = PREFILL + step
        self.prefix_lens[...] = prefix
        self.input_ids[...] = 1000 + step * REQUESTS + xp.arange(REQUESTS, dtype=xp.int64)
        self.positions[...] = prefix
        self.out_cache_loc[...] = self.table[1:, prefix]
        if step == CORRUPT_AT_STEP:
            self.context.canary_buf[CORRUPT_SLOT, 0] ^= 0xFF  # a flipped token byte

    def decode_step(self) -> None:
        """The launches a graph captures: plan, verify the prefixes, write the new tokens."""
        kc.plan(req_pool_indices=self.rows, prefix_lens=self.prefix_lens,
                extend_seq_lens=self.extend_seq_lens, req_to_token=self.table,
                verify_plan=self.verify_plan, write_plan=self.write_plan)
        kc.verify(self.context, self.verify_plan)
        kc.write(self.context, self.write_plan, input_ids=self.input_ids,
                 positions=self.positions, out_cache_loc=self.out_cache_loc)


def assert_same_state(reference: Engine, device: Engine, step: int) -> None:
    ctx, dev = reference.context, device.context
    assert np.array_equal(ctx.canary_buf, dev.canary_buf.get()), f"canary bytes, step {step}"
    for name in ("slot_run_counter", "kernel_run_counter"):
        assert int(getattr(ctx, name)[0]) == int(getattr(dev, name).get()[0]), (name, step)
    assert dev.violation_log.total == ctx.violation_log.total, f"violations, step {step}"
    assert sorted(map(tuple, dev.violation_log.rows().tolist())) == sorted(
        map(tuple, ctx.violation_log.rows().tolist())), f"violation rows, step {step}"


def run_replays(reference: Engine, device: Engine, replay, sync) -> None:
    for step in range(1, STEPS):
        reference.set_step(step)
        reference.decode_step()
        device.set_step(step)
        sync()
        replay()
        sync()
        assert_same_state(reference, device, step)
    assert reference.context.violation_log.total > 0  # the corrupted slot was seen


def started_engines(cupy):
    """Reference and device engines after prefill and one eager decode step (which also
    compiles every kernel: nothing may compile during a capture)."""
    reference, device = Engine(np), Engine(cupy)
    for engine in (reference, device):
        engine.prefill()
        engine.set_step(0)
        engine.decode_step()
    cupy.cuda.Device().synchronize()
    assert_same_state(reference, device, 0)
    return reference, device


def test_launches_follow_kv_writes_on_torch_stream(torch_cupy):
    torch, cupy = torch_cupy
    reference = Engine(np)
    reference.prefill()
    device = Engine(cupy)
    kc.plan(req_pool_indices=device.rows, prefix_lens=cupy.full(REQUESTS, PREFILL, cupy.int64),
            extend_seq_lens=cupy.zeros(REQUESTS, cupy.int64), req_to_token=device.table,
            verify_plan=device.verify_plan, write_plan=device.write_plan)
    kc.verify(device.context, device.verify_plan)  # compiles; the buffer is still empty
    cupy.cuda.Device().synchronize()
    device.context.violation_log.clear()
    canary = torch.from_dlpack(device.context.canary_buf)  # the same memory
    written = torch.from_numpy(reference.context.canary_buf).cuda()
    torch.cuda.synchronize()  # everything before this point is done; only the order below counts
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # holds the stream, so a verify elsewhere runs first
        canary.copy_(written)  # the engine's KV (here: canary) writes, queued on its stream
        with cupy.cuda.ExternalStream(side.cuda_stream):
            kc.verify(device.context, device.verify_plan)
    side.synchronize()
    assert device.context.violation_log.total == 0
    assert int(device.context.slot_run_counter.get()[0]) == 2 * REQUESTS * PREFILL


def test_torch_cuda_graph_replays_plan_verify_write(torch_cupy):
    torch, cupy = torch_cupy
    reference, device = started_engines(cupy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            device.decode_step()
    run_replays(reference, device, graph.replay, torch.cuda.synchronize)


def test_cupy_graph_replays_plan_verify_write(torch_cupy):
    _, cupy = torch_cupy
    reference, device = started_engines(cupy)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        device.decode_step()
        graph = stream.end_capture()
    run_replays(reference, device, lambda: graph.launch(stream),
                cupy.cuda.Device().synchronize)
