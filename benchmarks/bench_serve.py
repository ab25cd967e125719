"""Cost of guarding a server: the same load against transformers' own server unguarded and
against ``kvcanary serve`` with sources k0 and kv-all, in one run, rounds alternating.

Three servers run side by side on loopback (a random Llama, CPU, continuous batching, block
size 16, 64 blocks by default; ``--size`` 2x64 by default, a tiny model whose step is nearly
all Python, the guard's worst case; 12x768, GPT-2 small's shape, the smallest model anyone
serves); each round sends the same ``--requests`` completions
(``--concurrency`` at a time, ``--max-tokens`` each, prompts of 8 to 40 words, a third of
them sharing a prefix) to each server in turn, through the ``openai`` client. Per server:
generated tokens per second of wall time and the p50/p99 latency of a request, each the
median over the rounds, beside the median of each guarded round's ratio to the mean of the
unguarded rounds on either side of it (one more unguarded round closes the run, so every
guarded round has one before and one after it: a machine whose speed drifts during a run then
moves both sides of a ratio alike);
and, from each guarded server's ``/kvcanary/summary``, the median
guard and engine time per step (which the machine's load moves far less). Goal: k0
throughput at least 97% of unguarded, p99 at most 1.05x.
Needs kvcanary[serve].

Usage: python benchmarks/bench_serve.py [--quick] [--rounds N] [--requests N]
       [--concurrency N] [--max-tokens N] [--size LAYERSxHIDDEN] [--num-blocks N]
       [--sources k0,kv-all] [--model DIR] [--json PATH]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from serve_support import Server, build_tiny_model, get_json  # noqa: E402

SETUPS = (("unguarded", None), ("k0", "k0"), ("kv-all", "kv-all"))
WORDS = ["the", "quick", "brown", "fox", "canary", "cache", "block", "server", "hello",
         "world", "key", "value", "paged", "shared", "lazy", "dog"]


def prompts(count: int, seed: int = 0) -> list:
    r = random.Random(seed)
    shared = " ".join(r.choice(WORDS) for _ in range(24))
    out = []
    for i in range(count):
        tail = " ".join(r.choice(WORDS) for _ in range(r.randrange(8, 40)))
        out.append(f"{shared} {tail}" if i % 3 == 0 else tail)
    return out


async def one_round(url: str, model: str, texts: list, concurrency: int, max_tokens: int):
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                timeout=600)
    sem = asyncio.Semaphore(concurrency)
    latencies, tokens = [], 0

    async def ask(prompt):
        nonlocal tokens
        async with sem:
            start = time.perf_counter()
            response = await client.completions.create(model=model, prompt=prompt,
                                                       max_tokens=max_tokens)
            latencies.append(time.perf_counter() - start)
            tokens += response.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*[ask(p) for p in texts])
    wall = time.perf_counter() - start
    await client.close()
    latencies.sort()
    return dict(tokens_per_s=tokens / wall, p50=latencies[len(latencies) // 2],
                p99=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))])


def bracketed(runs: list, unguarded: list, key: str) -> list:
    """Round ``i``'s ``key`` over the mean of unguarded rounds ``i`` (before it) and
    ``i + 1`` (after it); ``unguarded`` holds one round more than ``runs``."""
    return [r[key] / ((before[key] + after[key]) / 2)
            for r, before, after in zip(runs, unguarded, unguarded[1:])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 64 requests")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--size", default="2x64", help="layers x hidden of the random Llama "
                        "built here (heads of 64 wide above 64 wide)")
    parser.add_argument("--num-blocks", type=int, default=64, help="KV blocks of 16 tokens")
    parser.add_argument("--model", default=None, help="a model directory instead of a "
                        "random Llama built here")
    parser.add_argument("--sources", default="k0,kv-all", help="the guarded servers, "
                        "comma-separated (k0, kv-all); fewer servers, shorter rounds apart")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.sources.split(",") if name.strip()]
    unknown = sorted(set(chosen) - {name for name, sources in SETUPS if sources})
    if unknown or not chosen:
        parser.error(f"--sources: {', '.join(unknown) or 'none given'}; choose from k0, kv-all")
    if args.quick:
        args.rounds, args.requests = 2, 64
    work = tempfile.mkdtemp(prefix="kvcanary-bench-serve-")
    layers, hidden = (int(part) for part in args.size.lower().split("x"))
    heads = 4 if hidden <= 64 else hidden // 64
    model = args.model or build_tiny_model(os.path.join(work, "model"), layers=layers,
                                           hidden=hidden, heads=heads,
                                           kv_heads=2 if hidden <= 64 else heads)
    blocks = ("--cb-num-blocks", str(args.num_blocks))
    servers = {}
    try:
        for name, sources in SETUPS:
            if sources is not None and name not in chosen:
                continue
            log = os.path.join(work, f"{name}.log")
            servers[name] = (
                Server(model, log_path=log, unguarded=True, serve_options=blocks)
                if sources is None else
                Server(model, "--sources", sources, log_path=log, serve_options=blocks))
        texts = prompts(args.requests)
        for name, server in servers.items():          # warm-up: one small round each
            asyncio.run(one_round(server.url, model, texts[:16], args.concurrency, 4))
        rounds = {name: [] for name in servers}
        for _ in range(args.rounds):
            for name, server in servers.items():
                rounds[name].append(asyncio.run(one_round(server.url, model, texts,
                                                          args.concurrency, args.max_tokens)))
        # The closing unguarded round: the last guarded rounds' "after" side.
        closing = asyncio.run(one_round(servers["unguarded"].url, model, texts,
                                        args.concurrency, args.max_tokens))
        # The guard's own share of a step, which the machine's load moves far less.
        steps = {name: get_json(server.url + "/kvcanary/summary")["guards"][0]
                 for name, server in servers.items() if name != "unguarded"}
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = {name: {key: statistics.median(r[key] for r in runs)
                    for key in ("tokens_per_s", "p50", "p99")} for name, runs in rounds.items()}
    base = table["unguarded"]
    print(f"Llama {args.size if not args.model else args.model}, {args.num_blocks} blocks; "
          f"{args.rounds} rounds x {args.requests} requests, concurrency {args.concurrency}, "
          f"max_tokens {args.max_tokens}")
    # Each guarded round against the mean of the unguarded rounds before and after it: a
    # drift of the machine's speed during the run moves both sides of a ratio alike.
    around = rounds["unguarded"] + [closing]
    ratios = {name: {key: bracketed(runs, around, key) for key in ("tokens_per_s", "p99")}
              for name, runs in rounds.items() if name != "unguarded"}
    paired = {name: {key: statistics.median(values) for key, values in by_key.items()}
              for name, by_key in ratios.items()}
    paired["unguarded"] = {"tokens_per_s": 1.0, "p99": 1.0}
    print("| server | tokens/s | vs unguarded | per round | p50 (s) | p99 (s) | p99 vs "
          "unguarded | per round |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, row in table.items():
        print(f"| {name} | {row['tokens_per_s']:.1f} | "
              f"{row['tokens_per_s'] / base['tokens_per_s'] * 100:.1f}% | "
              f"{paired[name]['tokens_per_s'] * 100:.1f}% | {row['p50']:.2f} | "
              f"{row['p99']:.2f} | {row['p99'] / base['p99']:.2f}x | "
              f"{paired[name]['p99']:.2f}x |")
    for name, by_key in ratios.items():
        print(f"{name}, each round's tokens/s against the unguarded rounds around it: "
              + ", ".join(f"{100 * r:.1f}%" for r in by_key["tokens_per_s"]))
    print("| server | engine ms/step | guard ms/step | guard / engine step | findings |")
    print("| --- | --- | --- | --- | --- |")
    for name, g in steps.items():
        print(f"| {name} | {g['engine_ms_median']:.1f} | {g['guard_ms_median']:.1f} | "
              f"{g['guard_ms_median'] / g['engine_ms_median'] * 100:.1f}% | {g['findings']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "table": table, "paired": paired, "rounds": rounds,
                       "closing_unguarded": closing, "steps": steps},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
