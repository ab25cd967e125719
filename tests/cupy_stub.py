"""kvcanary's CUDA backend without a GPU: cupy arrays over made-up device addresses, a
stub backend that hands launches to a Python function, and CuPy's own kernel-argument
conversion driven with every launch's real argument list.

CuPy converts kernel arguments (``cupy.cuda.function``'s ``_pointer``, called from
``Function.__call__``) before its first driver call, so the conversion runs without a GPU:
a ``Function`` with no module, a stream with a null handle and cupy arrays over made-up
device addresses go through it, and the launch then stops at the first driver call (no
device here; an invalid function handle on a machine with one). A ``TypeError`` or an
``AssertionError`` before that point means the launch would fail on every device.

Run as a script (``python tests/cupy_stub.py``) it prints one JSON object: the CuPy
version and, per check of :data:`CHECKS` and case, ``"ok"`` or what went wrong.
tests/kernels/test_cuda_host_side.py runs the checks in-process and under each CuPy of
``KVCANARY_CUPY_PATHS``;
benchmarks/bench_host_overhead.py times API calls through :func:`stub_backend`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys

import numpy as np

from kvcanary import (CanaryContext, RealKvHashMode, RealKvSource, VerifyPlan, ViolationLog,
                      WritePlan)

# A plausible device address space: every array gets its own 256-byte aligned range.
_FAKE_BASE = 0x7F00_0000_0000


class Addresses:
    """Made-up device addresses, 256-byte aligned, one range per array."""

    def __init__(self):
        self.next = _FAKE_BASE

    def take(self, nbytes: int) -> int:
        address = self.next
        self.next += max(256, -(-nbytes // 256) * 256)
        return address


def device_array(cupy, host: np.ndarray, addresses: Addresses, device_id: int = 0):
    """A cupy array with ``host``'s shape, dtype and strides over a made-up address on GPU
    ``device_id`` (never dereferenced: no launch reaches a device)."""
    memory = cupy.cuda.UnownedMemory(addresses.take(host.nbytes), host.nbytes, None, device_id)
    return cupy.ndarray(host.shape, host.dtype, memptr=cupy.cuda.MemoryPointer(memory, 0),
                        strides=host.strides)


def on_device(cupy, value, addresses: Addresses):
    """``value`` (a plan, log, context or source built on numpy) with every array replaced
    by a device array, scratch included."""
    twin = copy.copy(value)
    names = getattr(value, "__dict__", None) or {
        name: getattr(value, name) for cls in type(value).__mro__
        for name in getattr(cls, "__slots__", ()) if hasattr(value, name)}   # a slotted source
    for name, array in dict(names).items():
        if isinstance(array, np.ndarray):
            object.__setattr__(twin, name, device_array(cupy, array, addresses))
    if isinstance(value, CanaryContext):
        twin.violation_log = on_device(cupy, value.violation_log, addresses)
        twin.real_kv_sources = tuple(on_device(cupy, s, addresses) for s in value.real_kv_sources)
    return twin


def _refuse_allocation(size):
    raise AssertionError(f"a launch allocated {size} bytes of device memory")


@contextlib.contextmanager
def stub_backend(cupy, run=None):
    """Within the block, kvcanary's CUDA backend takes cupy arrays on GPU 0 without a
    device: launches go to ``run(key, name, grid, args)`` (default: dropped), and a device
    allocation raises. Any other device call (a synchronisation, a copy to the host)
    raises too, since there is no device."""
    from kvcanary.backends import cuda
    from kvcanary.backends.cuda import launch as L

    launcher = L.Launcher(run or (lambda *args: None), multiprocessor_count=132)
    patches = [(cuda, "require_cupy", lambda: cupy), (L, "_launcher", lambda device_id: launcher),
               (cupy.cuda.runtime, "getDevice", lambda: 0)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    allocator = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(_refuse_allocation)
    try:
        yield launcher
    finally:
        cupy.cuda.set_allocator(allocator)
        for owner, name, value in saved:
            setattr(owner, name, value)


class World:
    """A context with a full set of real-KV sources (hashing on), plans and token arrays,
    all on made-up device memory of GPU 0."""

    def __init__(self, cupy, max_real_kv_sources: int = 4, *, num_slots: int = 64,
                 capacity: int = 16, bs: int = 3, tokens: int = 5):
        self.cupy, self.addresses = cupy, Addresses()
        self.num_slots, self.capacity, self.bs, self.tokens = num_slots, capacity, bs, tokens
        sources = tuple(RealKvSource(np.zeros((self.num_slots, 32), np.uint8), page_size=1,
                                     num_bytes_per_token=32, read_bytes=32)
                        for _ in range(max_real_kv_sources))
        host_context = CanaryContext(
            np.zeros((self.num_slots, 32), np.uint8), kernel_kind=0,
            violation_log=ViolationLog.allocate(8), slot_run_counter=np.zeros(1, np.int64),
            kernel_run_counter=np.zeros(1, np.int64), real_kv_sources=sources,
            real_kv_hash_mode=RealKvHashMode.ALL, max_real_kv_sources=max_real_kv_sources)
        self.context = on_device(cupy, host_context, self.addresses)
        self.verify_plan = on_device(cupy, VerifyPlan.allocate(self.capacity), self.addresses)
        self.write_plan = on_device(cupy, WritePlan.allocate(self.bs), self.addresses)

    def device(self, shape, dtype=np.int64, device_id: int = 0):
        return device_array(self.cupy, np.zeros(shape, dtype), self.addresses, device_id)

    def plan_inputs(self, table_dtype=np.int32, optional: bool = True) -> dict:
        inputs = dict(req_pool_indices=self.device(self.bs), prefix_lens=self.device(self.bs),
                      extend_seq_lens=self.device(self.bs),
                      req_to_token=self.device((4, 32), table_dtype),
                      verify_plan=self.verify_plan, write_plan=self.write_plan)
        if optional:
            inputs.update(swa_window_size=8, full_to_swa_index_mapping=self.device(self.num_slots),
                          req_to_verify_expected_tokens=self.device((4, 32), table_dtype),
                          req_to_verify_expected_tokens_valid_lens=self.device(self.bs),
                          kv_token_id_vs_position_offset=1)
        return inputs

    def token_inputs(self, input_assert: bool = False) -> dict:
        inputs = dict(input_ids=self.device(self.tokens), positions=self.device(self.tokens),
                      out_cache_loc=self.device(self.tokens))
        if input_assert:
            inputs.update(expected_input_tokens=self.device(self.tokens),
                          expected_input_positions=self.device(self.tokens))
        return inputs


def launches(cupy, max_real_kv_sources: int = 4) -> list[tuple[str, str, tuple, list]]:
    """(label, kernel name, grid, args) of every launch the public API makes: plan (int32
    and int64 tables, with and without the optional inputs), write with and without the
    input assert, verify with and without the token check."""
    import kvcanary as kc

    world = World(cupy, max_real_kv_sources)
    recorded, label = [], [""]

    def record(key, name, grid, args):
        recorded.append((label[0], name, grid, list(args)))

    with stub_backend(cupy, record):
        for table_dtype in (np.int32, np.int64):
            label[0] = f"plan[{np.dtype(table_dtype).name} table]"
            kc.plan(**world.plan_inputs(table_dtype))
        label[0] = "plan[no optional inputs]"
        kc.plan(**world.plan_inputs(optional=False))
        for input_assert in (False, True):
            label[0] = f"write[input assert={input_assert}]"
            kc.write(world.context, world.write_plan, **world.token_inputs(input_assert))
        for check in (False, True):
            label[0] = f"verify[check_expected_token={check}]"
            kc.verify(world.context, world.verify_plan, check_expected_token=check)
    return recorded


class _NullStream:
    ptr = 0


def check_conversion(cupy) -> dict:
    """CuPy's conversion on every launch; ``{label/kernel (bound): "ok" or the error}``.
    Launches through the public API, so none of them allocated, synchronised or copied
    to the host either (the stub refuses all three)."""
    from cupy.cuda import function

    kernel = function.Function.__new__(function.Function)  # no module: ptr 0
    results = {}
    for bound in (1, 4, 64):
        for label, name, grid, args in launches(cupy, bound):
            key = f"{label}/{name} (bound {bound})"
            try:
                kernel(grid[:1], grid[1:], tuple(args), stream=_NullStream())
            except Exception as exc:  # the driver stage raises cupy_backends' own errors
                module = type(exc).__module__
                if module.startswith("cupy_backends") and type(exc).__name__.startswith("CUDA"):
                    results[key] = "ok"
                else:
                    results[key] = f"{type(exc).__name__}: {exc}"
            else:
                results[key] = "launched: a null function handle should not launch"
    return results


def check_mixed_devices(cupy) -> dict:
    """An array on another GPU than the canary buffer is one clear error naming it."""
    import kvcanary as kc

    world = World(cupy)
    inputs = world.token_inputs()
    inputs["positions"] = world.device(world.tokens, device_id=1)
    with stub_backend(cupy):
        try:
            kc.write(world.context, world.write_plan, **inputs)
        except ValueError as exc:
            expected = "positions is on GPU 1 but canary_buf is on GPU 0"
            return {"write": "ok" if expected in str(exc) else f"unclear: {exc}"}
    return {"write": "no error for arrays on two GPUs"}


def check_function_cache(cupy) -> dict:
    """Kernel functions are looked up once per (module variant, entry point)."""
    from kvcanary.backends.cuda import launch as L

    lookups = []

    class Module:
        def get_function(self, name):
            lookups.append(name)
            return lambda grid, block, args: None

    saved = L.module
    L.module = lambda *key: Module()
    L.kernel_function.cache_clear()
    try:
        for _ in range(3):
            for name in ("kvc_write_seeds", "kvc_write"):
                L._gpu_run(("write", 4, False), name, (1, 128), [])
    finally:
        L.module = saved
        L.kernel_function.cache_clear()
    return {"lookups": "ok" if lookups == ["kvc_write_seeds", "kvc_write"] else str(lookups)}


def _launch_world(kc, name: str, world: World) -> None:
    if name == "verify":
        kc.verify(world.context, world.verify_plan)
    else:
        kc.write(world.context, world.write_plan, **world.token_inputs())


def _set_shape(array, shape) -> None:
    array.shape = shape  # the one cupy array attribute settable in place


REPEAT_CHANGES = {  # case: (launch, change to a World)
    "verify plan shape in place": ("verify", lambda w: _set_shape(
        w.verify_plan.verify_slot_indices, (w.capacity // 2, 2))),
    "verify plan array replaced": ("verify", lambda w: setattr(
        w.verify_plan, "enable", w.device(1))),
    "write plan array replaced": ("write", lambda w: setattr(
        w.write_plan, "write_offsets", w.device(w.bs))),
    "counter replaced": ("verify", lambda w: setattr(
        w.context, "kernel_run_counter", w.device(2))),
    # (a source is immutable: another layout is a new source, here one too narrow for it)
    "source layout changed": ("write", lambda w: setattr(
        w.context, "real_kv_sources", (RealKvSource(
            w.context.real_kv_sources[0].tensor, page_size=2, num_bytes_per_token=32,
            read_bytes=32), *w.context.real_kv_sources[1:]))),
    "ring of another library": ("verify", lambda w: setattr(
        w.context.violation_log, "ring", np.zeros((8, 8), np.int64))),
    "plan array of another library": ("write", lambda w: setattr(
        w.write_plan, "write_num_valid_reqs", np.zeros(1, np.int32))),
}


def check_repeat_launch(cupy) -> dict:
    """After a launch that passed, each changed argument is checked again: the error is the
    one a first launch with the change gives."""
    import kvcanary as kc

    def error(name, world):
        try:
            _launch_world(kc, name, world)
        except ValueError as exc:
            return str(exc)
        return "no error"

    results = {}
    with stub_backend(cupy):
        for case, (name, change) in REPEAT_CHANGES.items():
            fresh = World(cupy)
            change(fresh)
            expected = error(name, fresh)
            reused = World(cupy)
            _launch_world(kc, name, reused)
            _launch_world(kc, name, reused)
            change(reused)
            got = error(name, reused)
            results[case] = ("ok" if got == expected != "no error"
                             else f"after a launch {got!r}, first launch {expected!r}")
    return results


def check_aliasing(cupy) -> dict:
    """Each case of tests/alias_cases.py on device arrays: an argument over another's device
    memory (the same made-up address) is refused naming both, before any launch."""
    import kvcanary as kc
    from alias_cases import CASES, run_case

    def alias(target, shape, dtype):
        return cupy.ndarray(shape, dtype, memptr=target.data)

    launched = []
    with stub_backend(cupy, lambda *args: launched.append(args)):
        results = {}
        for case, (_, _, expected) in CASES.items():
            before = len(launched)
            outcome = run_case(kc, World(cupy, 2), alias, case)
            if outcome == "ok" and expected is not None and len(launched) != before:
                outcome = "refused after a launch"
            results[case] = outcome
    return results


CHECKS = {"conversion": check_conversion, "mixed_devices": check_mixed_devices,
          "function_cache": check_function_cache, "repeat_launch": check_repeat_launch,
          "aliasing": check_aliasing}


def run_checks(cupy) -> dict:
    """``{check: {case: "ok" or what went wrong}}``; an exception is the case "raised"."""
    results = {}
    for name, check in CHECKS.items():
        try:
            results[name] = check(cupy)
        except Exception as exc:  # noqa: BLE001 - reported, not raised, across processes
            results[name] = {"raised": f"{type(exc).__name__}: {exc}"}
    return results


def main() -> int:
    import cupy

    print(json.dumps({"cupy": cupy.__version__, "numpy": np.__version__,
                      "results": run_checks(cupy)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
