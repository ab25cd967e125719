"""vLLM's CPU build running a tiny random-weight Llama in-process, for the model-runner mode:
a local model (``save_pretrained`` of a 2-layer Llama, a word-level tokenizer trained with
``tokenizers``), an ``LLM`` with the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and a seeded workload of requests sharing a prefix,
arriving a few per step, driven by ``llm_engine.step()``."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK_SIZE = 32          # the CPU attention backend's block sizes are multiples of 32


@dataclass
class Workload:
    """One seeded workload."""

    seed: int = 0
    requests: int = 8
    shared_prefix: int = 40
    prompt_range: tuple = (10, 90)
    output_range: tuple = (4, 20)
    arrivals_per_step: int = 3


def build_model(path: str) -> str:
    """A 2-layer Llama with random weights (one KV head of 32) and its tokenizer, saved under
    ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([" ".join(f"w{i}" for i in range(400))], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<s>", "</s>"], vocab_size=512))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, num_hidden_layers=2,
                         vocab_size=len(fast), max_position_embeddings=1024, bos_token_id=1,
                         eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def make_llm(model: str, *, prefix_caching: bool, num_blocks: int, max_batched: int = 64):
    """An in-process ``LLM`` on the CPU build: ``num_blocks`` blocks of 32 tokens,
    ``max_batched`` tokens per step (chunked prefill), eager mode."""
    from vllm import LLM

    return LLM(model=model, enforce_eager=True, block_size=BLOCK_SIZE, dtype="float32",
               max_model_len=160, num_gpu_blocks_override=num_blocks, max_num_seqs=6,
               max_num_batched_tokens=max_batched, enable_chunked_prefill=True,
               enable_prefix_caching=prefix_caching, async_scheduling=False, seed=0)


def parts(llm):
    """``(scheduler, model runner)`` of an in-process ``LLM``."""
    core = llm.llm_engine.engine_core.engine_core
    worker = core.model_executor.driver_worker
    return core.scheduler, getattr(worker, "worker", worker).model_runner


def run(llm, w: Workload, on_step=None) -> dict:
    """Drive the engine through workload ``w``; ``on_step(step)`` runs before each step.
    Returns the steps, the preemptions seen and the engine's step seconds."""
    from vllm import SamplingParams

    rng = np.random.default_rng(w.seed)
    prefix = rng.integers(3, 400, w.shared_prefix).tolist()
    todo = []
    for i in range(w.requests):
        tokens = prefix[:rng.integers(0, w.shared_prefix + 1)] + \
            rng.integers(3, 400, int(rng.integers(*w.prompt_range))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(*w.output_range)), ignore_eos=True,
                                temperature=0.8)   # per-request seeds: not on the CPU
        todo.append((f"s{w.seed}-r{i}", {"prompt_token_ids": tokens}, params))
    engine = llm.llm_engine
    scheduler, _ = parts(llm)
    # A guard knows only what it saw written: blocks cached by an earlier run (unguarded, or
    # another guard's) would be prefix hits on records it never wrote.
    scheduler.reset_prefix_cache()
    seen = dict(preempted=0)
    original = scheduler.schedule

    def schedule(*args, **kwargs):      # counts the preemptions each step reports
        out = original(*args, **kwargs)
        seen["preempted"] += len(out.preempted_req_ids or ())
        return out

    scheduler.schedule = schedule
    steps, times = 0, []
    try:
        while todo or engine.has_unfinished_requests():
            for rid, prompt, params in todo[:w.arrivals_per_step]:
                engine.add_request(rid, prompt, params)
            todo = todo[w.arrivals_per_step:]
            if on_step is not None:
                on_step(steps)
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            steps += 1
    finally:
        del scheduler.schedule
    return dict(steps=steps, preempted=seen["preempted"], step_times=times)
