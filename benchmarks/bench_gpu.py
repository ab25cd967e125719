"""GPU throughput of the CUDA kernels, each beside a figure measured in the same run:

  copy     cupy device-to-device copy of 1 GiB: the bandwidth yardstick (read + write bytes)
  (kernel figures are device times of launches replayed from a CUDA graph, so Python's
  per-call argument checks are not in them)
  verify   1M and 16M entries, mode NONE, clean chains; bytes counted per entry: the plan
           entry it reads (slot, position, predecessor: 24 B) and its own 32-byte record.
           Predecessor records are other entries' records (already counted), so they are
           not counted again; reported as a fraction of the copy bandwidth
  write    decode, 256 requests x 1 token: device time per launch (CUDA graph of 200
           back-to-back launches), and the host-side kc.write call for comparison
  real-KV  verify of 1M entries in mode ALL with 2 sources x 256 B/token: source bytes
           hashed per second

Prints "no GPU" and exits 0 when cupy sees no device. With --json, the file is rewritten as
each figure arrives, so a failure midway still leaves the figures measured before it (and
an "error" entry naming the step that failed).
Usage: python benchmarks/bench_gpu.py [--quick] [--json PATH]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import kvcanary as kc

TARGETS = {"verify_fraction_of_copy": 0.60, "write_decode_us": 10.0, "realkv_all_gbps": 650.0}
LENGTH = 4096  # tokens per request in the synthetic pools


class Figures(dict):
    """Figures by name, written to ``path`` (when given) each time one is set."""

    def __init__(self, path: str | None):
        super().__init__()
        self.path = path

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if self.path:
            partial = f"{self.path}.partial"
            with open(partial, "w", encoding="utf-8") as fh:
                json.dump(self, fh, indent=2)
            os.replace(partial, self.path)


def gpu():
    from kvcanary.backends.cuda import CudaUnavailable, require_cupy

    try:
        return require_cupy()
    except CudaUnavailable as exc:
        print(f"no GPU: {exc}")
        return None


def device_ms(cp, fn, repeats=10) -> float:
    """Median device time of ``fn`` in milliseconds (CUDA events, after a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def graph_us(cp, fn, launches: int) -> float:
    """Device time per call of ``fn`` in microseconds: ``launches`` calls captured in one
    CUDA graph, replayed once to warm up and once timed, so host overhead is excluded."""
    fn()  # compile and warm outside the capture
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(launches):
            fn()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / launches


def copy_bandwidth(cp, nbytes: int) -> float:
    src = cp.ones(nbytes // 8, dtype=cp.int64)
    dst = cp.empty_like(src)
    ms = device_ms(cp, lambda: cp.copyto(dst, src))
    return 2 * nbytes / (ms * 1e-3)


def pool(cp, entries: int, sources=(), mode=kc.RealKvHashMode.NONE):
    """A device canary buffer with entries/LENGTH clean chains, and the verify plan of all."""
    reqs = max(1, entries // LENGTH)
    num_slots = reqs * LENGTH + 1
    table = cp.zeros((reqs + 1, LENGTH), dtype=cp.int32)
    table[1:] = cp.arange(1, num_slots, dtype=cp.int32).reshape(reqs, LENGTH)
    ctx = kc.CanaryContext(
        cp.zeros((num_slots, 32), dtype=cp.uint8), kernel_kind=kc.LaunchTag.TAIL_K_FULL,
        violation_log=kc.ViolationLog.allocate(1024, xp=cp),
        slot_run_counter=cp.zeros(1, cp.int64), kernel_run_counter=cp.zeros(1, cp.int64),
        real_kv_sources=sources, real_kv_hash_mode=mode)
    rows = cp.arange(1, reqs + 1, dtype=cp.int64)

    def plan(prefix, extend):
        verify_plan = kc.VerifyPlan.allocate(max(1, reqs * prefix), xp=cp)
        write_plan = kc.WritePlan.allocate(reqs, xp=cp)
        kc.plan(req_pool_indices=rows, prefix_lens=cp.full(reqs, prefix, cp.int64),
                extend_seq_lens=cp.full(reqs, extend, cp.int64), req_to_token=table,
                verify_plan=verify_plan, write_plan=write_plan)
        return verify_plan, write_plan

    _, write_plan = plan(0, LENGTH)
    tokens = cp.random.randint(0, 150_000, size=reqs * LENGTH, dtype=cp.int64)
    positions = cp.tile(cp.arange(LENGTH, dtype=cp.int64), reqs)
    kc.write(ctx, write_plan, input_ids=tokens, positions=positions,
             out_cache_loc=table[1:].reshape(-1).astype(cp.int64))
    verify_plan, _ = plan(LENGTH, 0)
    return ctx, verify_plan, table, plan


def raw_verify(ctx, verify_plan):
    """The verify launch without the API's per-call argument checks (host-side work)."""
    from kvcanary.backends.cuda import launch as L

    return lambda: L.verify(ctx, verify_plan, check_expected_token=False)


def bench_verify(cp, entries, copy_bps, results):
    ctx, verify_plan, _, _ = pool(cp, entries)
    n = int(verify_plan.verify_num_valid.get()[0])
    kc.verify(ctx, verify_plan)  # once through the public API
    ms = graph_us(cp, raw_verify(ctx, verify_plan), 10) / 1e3
    if int(ctx.violation_log.write_index.get()[0]):
        raise SystemExit("verify pool is not clean")
    bytes_touched = n * (24 + 32)
    bps = bytes_touched / (ms * 1e-3)
    fraction = bps / copy_bps
    print(f"verify {n:>10,} entries NONE   {ms * 1e3:10.1f} us  {n / (ms * 1e-3):>16,.0f} entries/s"
          f"  {bps / 1e9:8.1f} GB/s = {fraction:5.1%} of copy")
    results[f"verify_{n}"] = {"us": ms * 1e3, "gbps": bps / 1e9, "fraction_of_copy": fraction}
    del ctx, verify_plan
    cp.get_default_memory_pool().free_all_blocks()


def bench_realkv(cp, entries, results):
    reqs_slots = max(1, entries // LENGTH) * LENGTH + 1
    sources = [kc.RealKvSource(cp.random.randint(0, 256, size=(reqs_slots, 256), dtype=cp.uint8),
                               page_size=1, num_bytes_per_token=256, read_bytes=256)
               for _ in range(2)]
    ctx, verify_plan, _, _ = pool(cp, entries, sources, kc.RealKvHashMode.ALL)
    n = int(verify_plan.verify_num_valid.get()[0])
    kc.verify(ctx, verify_plan)
    ms = graph_us(cp, raw_verify(ctx, verify_plan), 10) / 1e3
    if int(ctx.violation_log.write_index.get()[0]):
        raise SystemExit("real-KV pool is not clean")
    hashed = n * 2 * 256
    gbps = hashed / (ms * 1e-3) / 1e9
    print(f"real-KV ALL 2x256B {n:>10,} entries {ms * 1e3:10.1f} us  {gbps:8.1f} GB/s hashed")
    results["realkv_all"] = {"us": ms * 1e3, "gbps": gbps}


def bench_write_decode(cp, results, reqs=256):
    from kvcanary.backends.cuda import launch as L

    ctx, _, table, plan = pool(cp, reqs * LENGTH)
    _, write_plan = plan(LENGTH - 1, 1)
    loc = table[1:, LENGTH - 1].astype(cp.int64)
    tokens = cp.arange(reqs, dtype=cp.int64)
    positions = cp.full(reqs, LENGTH - 1, cp.int64)
    kwargs = dict(input_ids=tokens, positions=positions, out_cache_loc=loc)
    device_us = graph_us(cp, lambda: L.write(ctx, write_plan, **kwargs), 200)
    cp.cuda.Device().synchronize()
    host = []
    for _ in range(200):
        t = time.perf_counter()
        kc.write(ctx, write_plan, **kwargs)
        host.append(time.perf_counter() - t)
    cp.cuda.Device().synchronize()
    host_us = statistics.median(host) * 1e6
    print(f"write decode {reqs}x1            {device_us:10.2f} us/launch on the device (graph)"
          f"   kc.write call {host_us:8.1f} us on the host")
    results["write_decode"] = {"device_us": device_us, "host_call_us": host_us}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    cp = gpu()
    if cp is None:
        return 0
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    print(f"kvcanary {kc.__version__} on {name} ({sms} SMs), cupy {cp.__version__}")
    results = Figures(args.json)
    results["device"] = name
    results["multiprocessors"] = sms
    step = "copy"
    try:
        copy_bps = copy_bandwidth(cp, (64 << 20) if args.quick else (1 << 30))
        print(f"copy d2d                          {copy_bps / 1e9:8.1f} GB/s (read + write)")
        results["copy_gbps"] = copy_bps / 1e9
        for entries in ((1 << 16,) if args.quick else (1 << 20, 1 << 24)):
            step = f"verify {entries}"
            bench_verify(cp, entries, copy_bps, results)
        step = "write decode"
        bench_write_decode(cp, results, reqs=32 if args.quick else 256)
        step = "real-KV"
        bench_realkv(cp, (1 << 16) if args.quick else (1 << 20), results)
    except BaseException as exc:
        results["error"] = f"{step}: {type(exc).__name__}: {exc}"
        raise
    if not args.quick:
        worst = min(v["fraction_of_copy"] for k, v in results.items() if k.startswith("verify_"))
        print(f"targets: verify >= 60% of copy: {worst:.1%}; write decode < 10 us: "
              f"{results['write_decode']['device_us']:.2f} us; real-KV ALL >= 650 GB/s: "
              f"{results['realkv_all']['gbps']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
