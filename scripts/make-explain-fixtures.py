#!/usr/bin/env python3
"""Make the ``kvcanary explain`` test fixtures (tests/data/explain/) with SGLang's own
violation reporter, so the blocks are exactly what an SGLang server logs.

    pip download --no-deps sglang==0.5.23 -d /tmp/sglang-wheel
    python scripts/make-explain-fixtures.py /tmp/sglang-wheel/sglang-0.5.23-*.whl tests/data/explain

Only the reporter module and the two modules it takes its enums from are loaded from the
wheel (into a temporary directory, never into this repository); the modules they would pull
in for a running server (configuration, device state, JIT loading) are stood in for by
minimal stubs. The corruptions themselves are real: a toy engine runs plan / write / verify
with kvcanary on the host, laid out as SGLang's endpoints are: HEAD and TAIL launches for the
K and V canaries, each stage with its own canary buffer, the HEAD launches without real-KV
sources (the forward has not written the new tokens' KV yet when they run) and the TAIL ones
with them; one shared violation ring pumped to the reporter after every step. Each log
starts with the line SGLang logs when it installs the canary, its configuration rendered by
SGLang's own ``CanaryConfig``.
"""

from __future__ import annotations

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
           "sglang/kernels/ops/kv_canary/_dispatch.py",
           "sglang/srt/kv_canary/config.py")
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

    module("sglang.srt.environ", envs=None)             # read only by from_env, never called
    module("sglang.srt.runtime_context", get_observability=None)
    config = module("sglang.srt.kv_canary.config", MEMBERS[4])
    module("sglang.srt.kv_canary.state", CanaryDeviceState=object)
    reporter = module("sglang.srt.kv_canary.runner.violation_reporter", MEMBERS[0])
    return reporter, config


def install_line(config_module, consts, ring_capacity: int, disaggregation: str) -> str:
    """The start-up line SGLang logs when it installs the canary (api.py's format), with a
    configuration made by SGLang's ``CanaryConfig``."""
    config = config_module.CanaryConfig(
        mode=config_module.CanaryMode.LOG, ring_capacity=ring_capacity, sweep_interval=0,
        real_kv_hash_mode=consts.RealKvHashMode.ALL, enable_write_input_assert=False,
        enable_verify_token_assert=True, stats_print_every_n_steps=0)
    return (f"install_canary: disaggregation_mode={disaggregation} config={config} "
            "perturb_config=None launch_capacities=None n_buffer_groups=1 "
            "buffer_group_kinds=['FULL'] swa_window_size=0 speculative_num_steps=1")


STAGES = ("HEAD", "TAIL")
# decode.log's ring: it fills up during the last step (172 rows are reported by then).
RING_ROWS = 160


class ToyEngine:
    """Requests of ``length`` tokens in consecutive slots; K and V canaries, one buffer per
    stage (HEAD, TAIL) as SGLang's endpoints keep them, and one real-KV source per half that
    only the TAIL launches (and a sweep, which reads the TAIL buffer) carry; every step
    verifies every live prefix with HEAD and TAIL launches of both halves, into one ring of
    ``ring_capacity`` rows."""

    def __init__(self, requests: int, length: int, ring_capacity: int):
        import torch

        self.torch = torch
        num_slots = 1 + requests * length + 8
        self.table = np.zeros((requests + 1, length), np.int64)
        for r in range(1, requests + 1):
            self.table[r] = 1 + (r - 1) * length + np.arange(length)
        self.rows = np.arange(1, requests + 1, dtype=np.int64)
        self.length = length
        self.ring_capacity = ring_capacity
        rng = np.random.default_rng(0)
        self.kv = {half: rng.integers(0, 255, (num_slots, 16), dtype=np.uint8) for half in "KV"}
        self.canary = {(stage, half): np.zeros((num_slots, 32), np.uint8)
                       for stage in STAGES for half in "KV"}
        self.ring = kc.ViolationLog.allocate(ring_capacity)
        self.tokens = rng.integers(1, 30000, (requests + 1, length)).astype(np.int64)
        for stage in STAGES:
            for half in "KV":
                ctx = self.context(f"{stage}_{half}_FULL")
                vp, wp = kc.VerifyPlan.allocate(1), kc.WritePlan.allocate(requests)
                kc.plan(req_pool_indices=self.rows, prefix_lens=np.zeros(requests, np.int64),
                        extend_seq_lens=np.full(requests, length, np.int64),
                        req_to_token=self.table, verify_plan=vp, write_plan=wp)
                kc.write(ctx, wp, input_ids=self.tokens[1:].reshape(-1),
                         positions=np.tile(np.arange(length, dtype=np.int64), requests),
                         out_cache_loc=self.table[1:].reshape(-1))

    def fields(self, stage: str, half: str) -> np.ndarray:
        """The int64 fields (token, position, chain link, ...) of one canary buffer."""
        return self.canary[stage, half].view("<i8")[:, :4]

    def context(self, tag: str) -> kc.CanaryContext:
        stage, half, _ = tag.split("_")
        buffer = "TAIL" if stage == "SWEEP" else stage   # the sweep reads the TAIL buffer
        sources = () if stage == "HEAD" else (
            kc.RealKvSource(self.kv[half], page_size=1, num_bytes_per_token=16, read_bytes=16),)
        return kc.CanaryContext(
            self.canary[buffer, half], kernel_kind=kc.LaunchTag[tag], violation_log=self.ring,
            slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64),
            real_kv_sources=sources, real_kv_hash_mode=kc.RealKvHashMode.ALL)

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


def serve(sglang, path: str, engine: ToyEngine, steps: int, corrupt, *,
          disaggregation: str = "null") -> None:
    """Run ``steps`` steps, calling ``corrupt(engine, step, stage)`` before each launch
    stage (``head``, ``tail``, ``after``); the reporter logs into ``path`` with other
    server lines around it, after the canary's install line."""
    reporter_module, config_module, consts = sglang
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("sglang.srt.kv_canary.api").info(
        install_line(config_module, consts, engine.ring_capacity, disaggregation))
    server = logging.getLogger("sglang.srt.managers.scheduler")
    config = types.SimpleNamespace(mode=config_module.CanaryMode.LOG)
    reporter = reporter_module.ViolationReporter(config=config,
                                                 device_state=engine.device_state())
    for step in range(steps):
        server.info(f"Decode batch. #running-req: {engine.rows.size}, #token: "
                    f"{engine.rows.size * engine.length}, gen throughput (token/s): 812.40")
        for stage in STAGES:
            corrupt(engine, step, stage.lower())
            for half in "KV":
                engine.verify(f"{stage}_{half}_FULL")
        corrupt(engine, step, "after")
        reporter.log_or_raise_violation(outer_step_counter=step)
    handler.close()


def decode_log(engine: ToyEngine, step: int, stage: str) -> None:
    """Step 2: a slot rewritten by another sequence (its canary records in both stages'
    buffers and its KV bytes: every launch sees it from then on, the TAIL ones also the
    real-KV hash); step 3: a wrong token at position 5 of three requests in both buffers (one
    position, many slots); step 4, after the forward: one V byte of a slot changed (only TAIL
    launches, which carry the real-KV sources, see it, from step 5 on); step 6: a stray
    write into the HEAD K buffer only (the two canary copies disagree). The ring overflows
    at the last step."""
    if step == 2 and stage == "head":
        slot = engine.table[1, 3]
        for buffer in STAGES:
            for half in "KV":
                fields = engine.fields(buffer, half)
                fields[slot] = [4242, 77, 0x1234, fields[slot, 3]]
        for half in "KV":
            engine.kv[half][slot] ^= 0x5A
    if step == 4 and stage == "after":
        engine.kv["V"][engine.table[4, 6], 0] ^= 1
    if step == 3 and stage == "head":
        for r in (2, 3, 4):
            for buffer in STAGES:
                for half in "KV":
                    engine.fields(buffer, half)[engine.table[r, 5], 0] += 1
    if step == 6 and stage == "head":
        engine.fields("HEAD", "K")[engine.table[1, 6], 0] += 7


def pd_decode_log(engine: ToyEngine, step: int, stage: str) -> None:
    """The decode side of a prefill/decode pair: two slots' K bytes arrived changed (the
    TAIL launches, which carry the real-KV sources, see them)."""
    if step == 0 and stage == "head":
        engine.kv["K"][engine.table[1, 2], 3] ^= 0x10
        engine.kv["K"][engine.table[2, 4], 7] ^= 0x01


def clean(engine, step, stage) -> None:
    pass


def main(wheel: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        reporter, config = load_reporter(wheel, scratch)
        sglang = (reporter, config, sys.modules["sglang.kernels.ops.kv_canary.consts"])
        serve(sglang, os.path.join(out, "decode.log"),
              ToyEngine(requests=4, length=8, ring_capacity=RING_ROWS), steps=8, corrupt=decode_log)
        serve(sglang, os.path.join(out, "pd-prefill.log"),
              ToyEngine(requests=2, length=8, ring_capacity=64), steps=3, corrupt=clean,
              disaggregation="prefill")
        serve(sglang, os.path.join(out, "pd-decode.log"),
              ToyEngine(requests=2, length=8, ring_capacity=64), steps=3, corrupt=pd_decode_log,
              disaggregation="decode")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: make-explain-fixtures.py SGLANG_WHEEL OUT_DIR")
    main(*sys.argv[1:])
