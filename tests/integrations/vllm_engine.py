"""A vLLM scheduler driven with fake model outputs, on any host (no weights, no model runner):
a local tiny Llama ``config.json``, a hand-built ``KVCacheConfig`` (one full-attention group,
or a full and a sliding-window group), and the engine loop ``schedule`` ->
``ModelRunnerOutput`` -> ``update_from_output`` with seeded random sampled tokens."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@dataclass
class Config:
    """One seeded engine configuration."""

    seed: int = 0
    num_blocks: int = 24
    block_size: int = 16
    prefix_caching: bool = True
    chunked_prefill: bool = True
    max_num_batched_tokens: int = 128
    max_num_seqs: int = 8
    requests: int = 12
    shared_prefix: int = 40
    prompt_range: tuple = (20, 70)
    output_range: tuple = (4, 24)
    sliding_window: int = 0          # > 0: a second, sliding-window group
    arrivals_per_step: int = 3


def _model_dir(tmp_path) -> str:
    path = os.path.join(str(tmp_path), "tiny-llama")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                       intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, vocab_size=1000, max_position_embeddings=4096,
                       torch_dtype="float32"), f)
    return path


_VLLM_CONFIGS = {}


def make_scheduler(cfg: Config, tmp_path):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    key = (cfg.block_size, cfg.prefix_caching, cfg.chunked_prefill, cfg.max_num_batched_tokens,
           cfg.max_num_seqs)
    if "model" not in _VLLM_CONFIGS:
        _VLLM_CONFIGS["model"] = ModelConfig(model=_model_dir(tmp_path), skip_tokenizer_init=True,
                                             max_model_len=2048, dtype="float32")
    vc = _VLLM_CONFIGS.get(key)
    if vc is None:
        sc = SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_model_len=2048,
                             max_num_batched_tokens=cfg.max_num_batched_tokens,
                             enable_chunked_prefill=cfg.chunked_prefill,
                             is_encoder_decoder=False)
        cc = CacheConfig(block_size=cfg.block_size, enable_prefix_caching=cfg.prefix_caching)
        vc = _VLLM_CONFIGS[key] = VllmConfig(model_config=_VLLM_CONFIGS["model"],
                                             cache_config=cc, scheduler_config=sc)
    vc.cache_config.num_gpu_blocks = cfg.num_blocks
    full = FullAttentionSpec(block_size=cfg.block_size, num_kv_heads=2, head_size=16,
                             dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full)]
    if cfg.sliding_window:
        groups.append(KVCacheGroupSpec(["model.layers.1.self_attn.attn"], SlidingWindowSpec(
            block_size=cfg.block_size, num_kv_heads=2, head_size=16, dtype=torch.float32,
            sliding_window=cfg.sliding_window)))
    else:
        groups[0].layer_names.append("model.layers.1.self_attn.attn")
    kv = KVCacheConfig(num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return Scheduler(vc, kv, StructuredOutputManager(vc), block_size=cfg.block_size)


class Engine:
    """The engine loop around one scheduler: requests arrive a few per step, every scheduled
    request that finished its prompt samples one random token."""

    def __init__(self, cfg: Config, tmp_path):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.scheduler = make_scheduler(cfg, tmp_path)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(cfg.block_size, sha256)
        shared = self.rng.integers(1, 1000, size=cfg.shared_prefix).tolist()
        self.pending = []
        for i in range(cfg.requests):
            n = int(self.rng.integers(*cfg.prompt_range))
            prompt = (shared + self.rng.integers(1, 1000, size=n).tolist())[:max(n, 1)] \
                if self.rng.random() < 0.7 else self.rng.integers(1, 1000, size=n).tolist()
            self.pending.append((f"req-{i}", prompt, int(self.rng.integers(*cfg.output_range))))
        self.steps = 0
        self.preemptions = 0

    def add(self, request_id, prompt, max_tokens):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(Request(request_id, prompt, params, None,
                                           block_hasher=self.hasher))

    def step(self):
        from vllm.v1.outputs import ModelRunnerOutput

        s = self.scheduler
        for _ in range(self.cfg.arrivals_per_step):
            if self.pending:
                self.add(*self.pending.pop(0))
        out = s.schedule()
        self.preemptions += len(out.preempted_req_ids or ())
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = s.requests[rid]
            done = r.num_computed_tokens >= r.num_tokens   # advanced by schedule()
            sampled.append([int(self.rng.integers(1, 1000))] if done else [])
        s.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled))
        self.steps += 1
        return out

    def run(self, max_steps: int = 400):
        while (self.pending or self.scheduler.has_unfinished_requests()) and \
                self.steps < max_steps:
            self.step()
        return self
