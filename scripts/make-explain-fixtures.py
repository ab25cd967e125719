#!/usr/bin/env python3
"""Make the ``kvcanary explain`` test fixtures (tests/data/explain/) with SGLang's own
violation reporter, so the blocks are exactly what an SGLang server logs.

    pip download --no-deps sglang==0.5.23 -d /tmp/sglang-wheel
    python scripts/make-explain-fixtures.py /tmp/sglang-wheel/sglang-0.5.23-*.whl tests/data/explain

Only the reporter module and the two modules it takes its enums from are loaded from the
wheel (into a temporary directory, never into this repository); the modules they would pull
in for a running server (configuration, device state, JIT loading) are stood in for by
minimal stubs. The corruptions themselves are real: a toy engine runs plan / write / verify
with kvcanary on the host, HEAD and TAIL launches for the K and V canaries, one shared
violation ring pumped to the reporter after every step, as SGLang does.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
import sys
import tempfile
import types
import zipfile

import numpy as np

import kvcanary as kc

MEMBERS = ("sglang/srt/kv_canary/runner/violation_reporter.py",
           "sglang/kernels/ops/kv_canary/consts.py",
           "sglang/kernels/ops/kv_canary/verify.py",
           "sglang/kernels/ops/kv_canary/_dispatch.py")
LOG_FORMAT = "[%(asctime)s TP0] %(message)s"   # SGLang's server log format, with a TP prefix


def load_reporter(wheel: str, scratch: str):
    """SGLang's ViolationReporter and CanaryMode, loaded from the wheel's files."""
    with zipfile.ZipFile(wheel) as archive:
        for member in MEMBERS:
            archive.extract(member, scratch)

    def module(name, path=None, **attrs):
        if path is None:
            mod = types.ModuleType(name)
            mod.__path__ = []
        else:
            spec = importlib.util.spec_from_file_location(name, os.path.join(scratch, path))
            mod = importlib.util.module_from_spec(spec)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        if path is not None:
            spec.loader.exec_module(mod)
        return mod

    for package in ("sglang", "sglang.srt", "sglang.srt.kv_canary",
                    "sglang.srt.kv_canary.runner", "sglang.kernels", "sglang.kernels.ops",
                    "sglang.kernels.ops.kv_canary", "sglang.kernels.jit"):
        module(package)
    module("sglang.kernels.jit.utils", cache_once=lambda f: f, load_jit=None,
           make_cpp_args=None)
    consts = module("sglang.kernels.ops.kv_canary.consts", MEMBERS[1])
    sys.modules["sglang.kernels.ops.kv_canary"].consts = consts
    module("sglang.kernels.ops.kv_canary._dispatch", MEMBERS[3])
    module("sglang.kernels.ops.kv_canary.verify", MEMBERS[2])

    class CanaryMode(str, enum.Enum):   # the mode the reporter reads (stub of its config)
        NONE, LOG, RAISE = "none", "log", "raise"

    module("sglang.srt.kv_canary.config", CanaryMode=CanaryMode, CanaryConfig=object)
    module("sglang.srt.kv_canary.state", CanaryDeviceState=object)
    reporter = module("sglang.srt.kv_canary.runner.violation_reporter", MEMBERS[0])
    return reporter, CanaryMode


class ToyEngine:
    """Requests of ``length`` tokens in consecutive slots; K and V canaries with one real-KV
    source each; every step verifies every live prefix with HEAD and TAIL launches of both,
    into one ring of ``ring_capacity`` rows."""

    def __init__(self, requests: int, length: int, ring_capacity: int, *, sources=True):
        import torch

        self.torch = torch
        num_slots = 1 + requests * length + 8
        self.table = np.zeros((requests + 1, length), np.int64)
        for r in range(1, requests + 1):
            self.table[r] = 1 + (r - 1) * length + np.arange(length)
        self.rows = np.arange(1, requests + 1, dtype=np.int64)
        self.length = length
        rng = np.random.default_rng(0)
        self.kv = {half: rng.integers(0, 255, (num_slots, 16), dtype=np.uint8) for half in "KV"}
        self.canary = {half: np.zeros((num_slots, 32), np.uint8) for half in "KV"}
        self.ring = kc.ViolationLog.allocate(ring_capacity)
        self.sources = sources
        self.tokens = rng.integers(1, 30000, (requests + 1, length)).astype(np.int64)
        for half in "KV":
            ctx = self.context(f"HEAD_{half}_FULL")
            vp, wp = kc.VerifyPlan.allocate(1), kc.WritePlan.allocate(requests)
            kc.plan(req_pool_indices=self.rows, prefix_lens=np.zeros(requests, np.int64),
                    extend_seq_lens=np.full(requests, length, np.int64),
                    req_to_token=self.table, verify_plan=vp, write_plan=wp)
            kc.write(ctx, wp, input_ids=self.tokens[1:].reshape(-1),
                     positions=np.tile(np.arange(length, dtype=np.int64), requests),
                     out_cache_loc=self.table[1:].reshape(-1))

    def context(self, tag: str) -> kc.CanaryContext:
        half = tag.split("_")[1]
        sources = (kc.RealKvSource(self.kv[half], page_size=1, num_bytes_per_token=16,
                                   read_bytes=16),) if self.sources else ()
        return kc.CanaryContext(
            self.canary[half], kernel_kind=kc.LaunchTag[tag], violation_log=self.ring,
            slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64),
            real_kv_sources=sources,
            real_kv_hash_mode=kc.RealKvHashMode.ALL if self.sources else kc.RealKvHashMode.NONE)

    def verify(self, tag: str) -> None:
        vp = kc.VerifyPlan.allocate(self.rows.size * self.length)
        kc.plan(req_pool_indices=self.rows, prefix_lens=np.full(self.rows.size, self.length),
                extend_seq_lens=np.zeros(self.rows.size, np.int64), req_to_token=self.table,
                verify_plan=vp, write_plan=kc.WritePlan.allocate(self.rows.size),
                req_to_verify_expected_tokens=self.tokens,
                req_to_verify_expected_tokens_valid_lens=np.full(self.rows.size, self.length))
        kc.verify(self.context(tag), vp, check_expected_token=True)

    def device_state(self):
        torch = self.torch
        log = types.SimpleNamespace(violation_ring=torch.from_numpy(self.ring.ring),
                                    violation_write_index=torch.from_numpy(self.ring.write_index))
        return types.SimpleNamespace(violation_log=log)


def serve(reporter_module, mode, path: str, engine: ToyEngine, steps: int, corrupt) -> None:
    """Run ``steps`` steps, calling ``corrupt(engine, step, stage)`` before each launch
    stage (``head``, ``tail``, ``after``); the reporter logs into ``path`` with other
    server lines around it."""
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    server = logging.getLogger("sglang.srt.managers.scheduler")
    config = types.SimpleNamespace(mode=mode.LOG)
    reporter = reporter_module.ViolationReporter(config=config,
                                                 device_state=engine.device_state())
    for step in range(steps):
        server.info(f"Decode batch. #running-req: {engine.rows.size}, #token: "
                    f"{engine.rows.size * engine.length}, gen throughput (token/s): 812.40")
        for stage, tags in (("head", ("HEAD_K_FULL", "HEAD_V_FULL")),
                            ("tail", ("TAIL_K_FULL", "TAIL_V_FULL"))):
            corrupt(engine, step, stage)
            for tag in tags:
                engine.verify(tag)
        corrupt(engine, step, "after")
        reporter.log_or_raise_violation(outer_step_counter=step)
    handler.close()


def decode_log(engine: ToyEngine, step: int, stage: str) -> None:
    """Step 2: a slot overwritten by another sequence (seen by every launch from then on);
    step 3: one V byte flipped during the forward and restored after it (TAIL only);
    step 4: a wrong token at position 5 of three requests (one position, many slots)."""
    fields = {half: engine.canary[half].view("<i8")[:, :4] for half in "KV"}
    if step == 2 and stage == "head":
        for half in "KV":
            fields[half][engine.table[1, 3]] = [4242, 77, 0x1234, fields[half][1, 3]]
    if step == 3 and stage == "tail":
        engine.kv["V"][engine.table[2, 6], 0] ^= 1
    if step == 3 and stage == "after":
        engine.kv["V"][engine.table[2, 6], 0] ^= 1
    if step == 4 and stage == "head":
        for r in (2, 3, 4):
            for half in "KV":
                fields[half][engine.table[r, 5], 0] += 1


def pd_decode_log(engine: ToyEngine, step: int, stage: str) -> None:
    """The decode side of a prefill/decode pair: two slots' K bytes arrived changed."""
    if step == 0 and stage == "head":
        engine.kv["K"][engine.table[1, 2], 3] ^= 0x10
        engine.kv["K"][engine.table[2, 4], 7] ^= 0x01


def clean(engine, step, stage) -> None:
    pass


def main(wheel: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        reporter, mode = load_reporter(wheel, scratch)
        serve(reporter, mode, os.path.join(out, "decode.log"),
              ToyEngine(requests=4, length=8, ring_capacity=48), steps=8, corrupt=decode_log)
        serve(reporter, mode, os.path.join(out, "pd-prefill.log"),
              ToyEngine(requests=2, length=8, ring_capacity=64), steps=3, corrupt=clean)
        serve(reporter, mode, os.path.join(out, "pd-decode.log"),
              ToyEngine(requests=2, length=8, ring_capacity=64), steps=3, corrupt=pd_decode_log)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: make-explain-fixtures.py SGLANG_WHEEL OUT_DIR")
    main(*sys.argv[1:])
