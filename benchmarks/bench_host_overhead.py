"""Host-side time per call of kc.write, kc.verify and kc.plan on the CUDA path.

Without CUDA graphs this Python time sits on the decode critical path; the goal is at most
30 us per decode-step call. It is measured without a GPU: the public API runs on cupy
arrays over made-up device memory, and a stub takes each launch where CuPy's launch call
would be (tests/cupy_stub.py), so the figure is everything kvcanary does per call
(argument checks, argument lists, dispatch), not CuPy's own launch cost (one call per
kernel launch; bench_gpu.py times the whole call on a device). Times are the calling
thread's CPU time. Baselines in the same run: the CUDA backend called directly (device
check, argument lists, launches, without the API's argument checks), and the backend's
Launcher alone (argument lists and launches).

A decode step: 256 requests x 1 token, real-KV hashing on with 2 sources.
Needs CuPy importable (any build; no device): prints "no cupy" and exits 0 otherwise.
Usage: python benchmarks/bench_host_overhead.py [--calls N] [--repeats R] [--json PATH]"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

GOAL_US = 30.0


def per_call_us(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean CPU time of ``calls`` back-to-back calls, in us.
    The calling thread's CPU time, not wall time: on a shared machine wall time also
    counts the time other processes hold the core, which no launch costs."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.thread_time_ns()
        for _ in range(calls):
            fn()
        samples.append((time.thread_time_ns() - start) / calls / 1e3)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    try:
        import cupy
    except ImportError:
        print("no cupy: the host-overhead benchmark needs CuPy importable (no device needed)")
        return 0
    import kvcanary as kc
    from cupy_stub import World, stub_backend
    from kvcanary.backends.cuda import launch as backend

    world = World(cupy, num_slots=1 << 20, capacity=256 * 64, bs=256, tokens=256)
    world.context.real_kv_sources = world.context.real_kv_sources[:2]
    tokens = world.token_inputs()
    plan_inputs = world.plan_inputs(optional=False)
    calls = {  # name: (public API, backend, launcher)
        "write": (lambda: kc.write(world.context, world.write_plan, **tokens),
                  lambda: backend.write(world.context, world.write_plan, **tokens),
                  lambda launcher: launcher.write(world.context, world.write_plan, **tokens)),
        "verify": (lambda: kc.verify(world.context, world.verify_plan),
                   lambda: backend.verify(world.context, world.verify_plan,
                                          check_expected_token=False),
                   lambda launcher: launcher.verify(world.context, world.verify_plan,
                                                    check_expected_token=False)),
        "plan": (lambda: kc.plan(**plan_inputs), lambda: backend.plan(**plan_inputs),
                 lambda launcher: launcher.plan(**plan_inputs)),
    }
    launches = []
    results = {"cupy": cupy.__version__, "goal_us": GOAL_US}
    print(f"host time per call, decode step 256x1, cupy {cupy.__version__} (stub launches)")
    with stub_backend(cupy, lambda *launch: launches.append(launch)) as launcher:
        for name, (api_call, backend_call, launcher_call) in calls.items():
            launches.clear()
            api_call()
            count = len(launches)
            api_us = per_call_us(api_call, args.calls, args.repeats)
            backend_us = per_call_us(backend_call, args.calls, args.repeats)
            bare_us = per_call_us(lambda: launcher_call(launcher), args.calls, args.repeats)
            verdict = "meets" if api_us <= GOAL_US else "misses"
            print(f"kc.{name:<7} {api_us:7.1f} us/call ({count} launches, {verdict} the "
                  f"{GOAL_US:.0f} us goal)   backend {backend_us:6.1f} us   launcher "
                  f"{bare_us:6.1f} us   argument checks {api_us - backend_us:6.1f} us = "
                  f"{(api_us - backend_us) / api_us:4.0%} of the call")
            results[name] = {"api_us": api_us, "backend_us": backend_us, "launcher_us": bare_us,
                             "launches": count}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
