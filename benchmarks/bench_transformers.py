"""Cost of guarding transformers' continuous batching: the guard's time per forward step
beside the engine's own step time, measured in the same run.

Three randomly initialised Llama sizes (layers x hidden: 2 x 64, 4 x 256, 12 x 768; fp32, a
head dimension of 64 except at 64 wide) generate on the CPU with sources none (the canary
without real-KV fingerprints), k0 (layer 0's K rows) and kv-all (K and V of every layer),
hash mode all, token check on, plans from the read indices. Per step the guard times its
plan + verify before the forward and its write after it, and the engine's step between
them; the figures are medians over the steps of one generation (after one warm-up run).
Goals at 12 layers: k0 at most 2% of the step, kv-all at most 25%. The machine's load moves
both the guard's and the engine's times: compare ratios of one run. Needs torch and
transformers.

Usage: python benchmarks/bench_transformers.py [--quick] [--requests N] [--new-tokens N]
       [--json PATH]"""

from __future__ import annotations

import argparse
import json
import random
import sys

SIZES = ((2, 64), (4, 256), (12, 768))
SOURCES = (("none", ()), ("k0", "k0"), ("kv-all", "kv-all"))
GOAL_PERCENT = {"k0": 2.0, "kv-all": 25.0}    # at 12 layers


def make_model(layers: int, hidden: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=1024)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def generate(model, guard, prompts, new_tokens):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=512,
                                        max_requests_per_batch=len(prompts),
                                        use_async_batching=False)
    with guard:
        model.generate_batch(inputs=prompts, generation_config=config,
                             continuous_batching_config=batching)
    return guard.summary()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the two small sizes only")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as exc:
        print(f"needs torch and transformers ({exc}); pip install 'kvcanary[transformers]'")
        return 0
    from kvcanary.integrations import transformers as kvt

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    r = random.Random(0)
    prompts = [[r.randrange(1, 1024) for _ in range(args.prompt)] for _ in range(args.requests)]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.requests} requests x {args.prompt} prompt "
          f"+ {args.new_tokens} new tokens, page 16, hash mode all")
    print(f"{'model':<10}{'sources':<9}{'steps':>6}{'engine ms/step':>16}{'guard ms/step':>15}"
          f"{'guard / step':>14}")
    results = []
    for layers, hidden in SIZES[:2] if args.quick else SIZES:
        model = make_model(layers, hidden)
        generate(model, kvt.guard(model, sources=(), on_violation="raise"), prompts[:2], 2)
        for name, sources in SOURCES:
            g = kvt.guard(model, sources=sources, hash_mode="all", on_violation="raise")
            s = generate(model, g, prompts, args.new_tokens)
            if s["findings"]:
                print(f"unexpected findings on a clean run: {g.findings()[:3]}")
                return 1
            ratio = 100.0 * s["guard_ms_median"] / s["engine_ms_median"]
            row = dict(layers=layers, hidden=hidden, sources=name, steps=s["steps"],
                       engine_ms=s["engine_ms_median"], guard_ms=s["guard_ms_median"],
                       overhead_percent=ratio)
            results.append(row)
            print(f"{f'{layers}x{hidden}':<10}{name:<9}{s['steps']:>6}"
                  f"{s['engine_ms_median']:>16.2f}{s['guard_ms_median']:>15.2f}{ratio:>13.1f}%")
    for name, goal in GOAL_PERCENT.items():
        big = [r for r in results if (r["layers"], r["sources"]) == (12, name)]
        if big:
            verdict = "met" if big[0]["overhead_percent"] <= goal else "NOT met"
            print(f"goal: guard <= {goal:.0f}% of the step at 12 layers with {name}: {verdict} "
                  f"({big[0]['overhead_percent']:.1f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
