"""Run the CUDA kernel sources on the CPU: g++ compiles kernels/*.cu against a small
shim of CUDA's built-ins (cuda_shim.h) into a shared library, and ctypes launches the
grid sequentially, its threads in forward, reverse or shuffled order. The launch sequence
and argument lists are kvcanary's own (``kvcanary.backends.cuda.launch.Launcher``), so the tests
exercise them too.

Libraries are cached by a hash of every source and flag, under ``$KVCANARY_HARNESS_CACHE`` or
the user's own cache (``$XDG_CACHE_HOME/kvcanary/kernel-harness``, by default
``~/.cache/kvcanary/kernel-harness``), never in a temp folder other users share."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np

from kvcanary.backends.cuda import launch as L
from kvcanary.backends.kernel_source import kernel_dir
from kvcanary.model.arrays import data_address

HERE = Path(__file__).resolve().parent
DEFAULT_FLAGS = ("-O2",)
# Thread orders of a launch (harness.cpp's Order): a GPU fixes none of them.
ORDERS = {"forward": 0, "reverse": 1, "shuffled": 2}
SANITIZE_FLAGS = ("-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                  "-fno-sanitize-recover=undefined")
COVERAGE_FLAGS = ("-O0", "--coverage")  # gcov line counts (scripts/kernel-coverage.py)


def compiler() -> str | None:
    """The C++ compiler to use, or None when the machine has none."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cache_dir() -> Path:
    root = os.environ.get("KVCANARY_HARNESS_CACHE")
    if root:
        path = Path(root)
    else:
        user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        path = Path(user_cache) / "kvcanary" / "kernel-harness"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _source_digest() -> str:
    digest = hashlib.sha256()
    files = sorted(kernel_dir().glob("*.cu*")) + [HERE / "cuda_shim.h", HERE / "harness.cpp"]
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build(max_real_kv_sources: int = 4, check_expected_token: bool = False,
          flags: tuple[str, ...] = DEFAULT_FLAGS) -> Path:
    """Compile (or reuse) the harness library for one kernel variant; returns its path."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (g++, c++ or clang++)")
    defines = (f"-DKVC_MAX_REAL_KV_SOURCES={int(max_real_kv_sources)}",
               f"-DKVC_CHECK_VERIFY_EXPECTED_TOKEN={1 if check_expected_token else 0}")
    command = [cxx, "-std=c++20", "-shared", "-fPIC", "-Wall", "-Wextra",
               *flags, *defines, f"-I{kernel_dir()}", f"-I{HERE}"]
    key = hashlib.sha256((_source_digest() + "\0".join(command)).encode()).hexdigest()[:24]
    target = cache_dir() / f"kvc_harness_{key}.so"
    if not target.exists():
        partial = target.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        subprocess.run([*command, str(HERE / "harness.cpp"), "-o", str(partial)], check=True,
                       capture_output=True, text=True)
        os.replace(partial, target)
    return target


def build_variants(variants, flags: tuple[str, ...] = DEFAULT_FLAGS) -> None:
    """``build`` each (bound, token check) of ``variants``, one compiler per core at once:
    each compiles the whole harness (2-3 s at -O2, about 10 s under the sanitizers), which
    a test run would otherwise wait for one after another on a cold cache."""
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, min(len(variants), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda variant: build(*variant, flags=flags), variants))


@functools.lru_cache(maxsize=None)
def load(max_real_kv_sources: int = 4, check_expected_token: bool = False,
         flags: tuple[str, ...] = DEFAULT_FLAGS) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build(max_real_kv_sources, check_expected_token, flags)))
    lib.kvc_cpu_launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint,
                                   ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int,
                                   ctypes.c_uint]
    lib.kvc_cpu_launch.restype = ctypes.c_int
    lib.kvc_cpu_sources_size.restype = ctypes.c_long
    lib.kvc_cpu_sources_offset.restype = ctypes.c_long
    lib.kvc_cpu_sources_offset.argtypes = [ctypes.c_int]
    lib.kvc_cpu_write_args_size.restype = ctypes.c_long
    lib.kvc_cpu_write_args_offset.restype = ctypes.c_long
    lib.kvc_cpu_write_args_offset.argtypes = [ctypes.c_char_p]
    return lib


def marshal(args) -> tuple[ctypes.Array, list]:
    """cuLaunchKernel-style parameters: an array of pointers to each argument's value.
    Returns the array and the objects that must stay alive while it is used."""
    keep = []
    for arg in args:
        if isinstance(arg, np.ndarray) and arg.dtype.names is not None:
            # A by-value struct: a 0-d structured array, which CuPy passes by value too.
            value = ctypes.create_string_buffer(arg.tobytes(), arg.nbytes)
        elif isinstance(arg, np.ndarray):
            value = ctypes.c_void_p(data_address(arg))
        elif isinstance(arg, np.int64):
            value = ctypes.c_int64(int(arg))
        elif isinstance(arg, np.int32):
            value = ctypes.c_int32(int(arg))
        elif isinstance(arg, np.uint64):
            value = ctypes.c_uint64(int(arg))
        else:
            raise TypeError(f"kernel argument of unsupported type {type(arg).__name__}")
        keep.append(value)
    pointers = (ctypes.c_void_p * max(1, len(keep)))(
        *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in keep])
    return pointers, keep


class CpuKernels:
    """The backend interface (``plan``, ``write``, ``verify``) on numpy arrays, running
    the kernel source compiled for the CPU."""

    def __init__(self, multiprocessor_count: int = 2, threads_per_block: int = 8,
                 write_threads_per_block: int = 4, flags: tuple[str, ...] | None = None):
        self.flags = harness_flags_from_env() if flags is None else flags
        self.order, self.seed = "forward", 0  # thread order of the next launches
        self.launches = []  # (name, blocks, threads) of every launch, for geometry checks
        self._launcher = L.Launcher(self._run, multiprocessor_count,
                                    threads_per_block=threads_per_block,
                                    write_threads_per_block=write_threads_per_block)

    def _run(self, key, name, geometry, args) -> None:
        _, bound, check = key
        lib = load(bound if bound is not None else 4, check, self.flags)
        pointers, keep = marshal(args)
        blocks, threads = geometry
        self.launches.append((name, blocks, threads))
        rc = lib.kvc_cpu_launch(name.encode(), blocks, threads, pointers, len(keep),
                                ORDERS[self.order], self.seed)
        if rc != 0:
            raise RuntimeError(f"harness launch of {name} failed with {rc}")

    def plan(self, **kwargs) -> None:
        self._launcher.plan(**kwargs)

    def write(self, context, plan, **kwargs) -> None:
        self._launcher.write(context, plan, **kwargs)

    def verify(self, context, plan, *, check_expected_token: bool) -> None:
        self._launcher.verify(context, plan, check_expected_token=check_expected_token)


@contextlib.contextmanager
def numpy_runs(backend):
    """Within the block, kvcanary's numpy dispatch runs ``backend`` instead of the
    reference, after the API's full argument validation."""
    from kvcanary.api import launches as api

    original = api._backend_module

    def patched(name):
        return backend if name == "numpy" else original(name)

    api._backend_module = patched
    try:
        yield backend
    finally:
        api._backend_module = original


# ---------------------------------------------------------------------------------------
# Differential backend: the reference on copies, the kernels on the real arrays, then a
# byte-for-byte comparison of everything the launch may change.


def _copy_context(context):
    import copy

    twin = copy.copy(context)
    twin.canary_buf = context.canary_buf.copy()
    twin.slot_run_counter = context.slot_run_counter.copy()
    twin.kernel_run_counter = context.kernel_run_counter.copy()
    twin.enable_chain_position_assert = context.enable_chain_position_assert.copy()
    twin.violation_log = type(context.violation_log)(context.violation_log.ring.copy(),
                                                     context.violation_log.write_index.copy())
    return twin  # real-KV sources are shared: launches only read them


def _copy_plan(plan):
    import copy

    twin = copy.copy(plan)
    for name, value in vars(plan).items():
        if isinstance(value, np.ndarray):
            setattr(twin, name, value.copy())
    return twin


def _rows(ring, begin, end):
    return sorted(tuple(int(v) for v in row) for row in ring[begin:end])


class Mismatch(AssertionError):
    pass


def compare_contexts(expected, actual, index_before: int, full_rows=None) -> None:
    """Kernel context vs reference context after one launch. Rows recorded by this
    launch compare as a multiset when there is more than one; when only some of them
    land (the ring overflowed, or the index started negative), which ones depends on
    thread order, so the kernel's must be rows the reference produces (``full_rows``: the
    reference's rows with room for all of them)."""
    if not np.array_equal(expected.canary_buf, actual.canary_buf):
        diff = np.flatnonzero((expected.canary_buf != actual.canary_buf).any(axis=1))
        raise Mismatch(f"canary bytes differ at slots {diff[:10].tolist()}")
    for name in ("slot_run_counter", "kernel_run_counter"):
        if not np.array_equal(getattr(expected, name), getattr(actual, name)):
            raise Mismatch(f"{name}: reference {getattr(expected, name)} "
                           f"kernel {getattr(actual, name)}")
    e_log, a_log = expected.violation_log, actual.violation_log
    if not np.array_equal(e_log.write_index, a_log.write_index):
        raise Mismatch(f"write_index: reference {e_log.write_index} kernel {a_log.write_index}")
    after = int(a_log.write_index[0])
    capacity = a_log.ring.shape[0]
    begin = min(max(index_before, 0), capacity)
    end = min(max(after, 0), capacity) if after >= index_before else begin
    if not (np.array_equal(e_log.ring[:begin], a_log.ring[:begin])
            and np.array_equal(e_log.ring[end:], a_log.ring[end:])):
        raise Mismatch("ring rows outside this launch's range changed")
    if after - index_before <= 1 or not _some_dropped(index_before, after, capacity) \
            or full_rows is None:
        if _rows(e_log.ring, begin, end) != _rows(a_log.ring, begin, end):
            raise Mismatch(f"ring rows differ: reference {_rows(e_log.ring, begin, end)} "
                           f"kernel {_rows(a_log.ring, begin, end)}")
    else:
        pool = list(full_rows)
        for row in _rows(a_log.ring, begin, end):
            if row not in pool:
                raise Mismatch(f"kernel row {row} is not a row the reference records")
            pool.remove(row)


def _some_dropped(index_before: int, after: int, capacity: int) -> bool:
    return after > index_before and (index_before < 0 or after > capacity)


def compare_plans(expected, actual, what: str) -> None:
    """The plan's contents (its scratch is working memory and may differ)."""
    for name, value in expected.arrays().items():
        if not np.array_equal(value, actual.arrays()[name]):
            raise Mismatch(f"{what}.{name}: reference {value.tolist()[:16]} "
                           f"kernel {actual.arrays()[name].tolist()[:16]}")


class Differential:
    """Backend interface that runs the numpy reference first (its exceptions propagate
    unchanged, so the kernels never see input the reference rejects), then the kernels
    on the caller's arrays, and raises ``Mismatch`` on any byte difference.

    With CPU kernels every launch first runs in the other thread orders on copies, each
    compared with the reference the same way, then forward on the caller's arrays: a
    result that depends on thread order fails. (A GPU picks its own order.)"""

    def __init__(self, kernels):
        from kvcanary.backends import reference

        self.kernels = kernels
        self.reference = reference.BACKEND
        self.orders = ("reverse", "shuffled") if isinstance(kernels, CpuKernels) else ()
        self.compared = 0

    def _in_orders(self, run) -> None:
        """``run(last)`` once per extra order on copies (last=False), then forward on the
        caller's arrays (last=True)."""
        for order in self.orders:
            self.kernels.order, self.kernels.seed = order, self.compared + 1
            try:
                run(False)
            except Mismatch as exc:
                raise Mismatch(f"{order} thread order: {exc}") from None
            finally:
                self.kernels.order = "forward"
        run(True)

    def _all_rows(self, context, launch, count: int):
        """Reference rows of this launch with an empty ring big enough for all of them."""
        twin = _copy_context(context)
        twin.violation_log = type(context.violation_log)(
            np.zeros((count + 1, 8), dtype=np.int64), np.zeros(1, dtype=np.int32))
        launch(twin)
        return _rows(twin.violation_log.ring, 0, count)

    def _context_launch(self, context, launch) -> None:
        before = int(context.violation_log.write_index[0])
        twin = _copy_context(context)
        launch(self.reference, twin)
        full = None
        after = int(twin.violation_log.write_index[0])
        if after - before > 1 and _some_dropped(before, after, twin.violation_log.ring.shape[0]):
            full = self._all_rows(context, lambda c: launch(self.reference, c), after - before)

        def run(last: bool) -> None:
            target = context if last else _copy_context(context)
            launch(self.kernels, target)
            compare_contexts(twin, target, before, full)

        self._in_orders(run)
        self.compared += 1

    def verify(self, context, plan, *, check_expected_token: bool) -> None:
        self._context_launch(context, lambda backend, ctx: backend.verify(
            ctx, plan, check_expected_token=check_expected_token))

    def write(self, context, plan, **kwargs) -> None:
        self._context_launch(context, lambda backend, ctx: backend.write(ctx, plan, **kwargs))

    def plan(self, *, verify_plan, write_plan, **kwargs) -> None:
        expected_verify, expected_write = _copy_plan(verify_plan), _copy_plan(write_plan)
        self.reference.plan(verify_plan=expected_verify, write_plan=expected_write, **kwargs)

        def run(last: bool) -> None:
            verify_out = verify_plan if last else _copy_plan(verify_plan)
            write_out = write_plan if last else _copy_plan(write_plan)
            self.kernels.plan(verify_plan=verify_out, write_plan=write_out, **kwargs)
            compare_plans(expected_verify, verify_out, "verify_plan")
            compare_plans(expected_write, write_out, "write_plan")

        self._in_orders(run)
        self.compared += 1


def harness_flags_from_env() -> tuple[str, ...]:
    """Sanitizer build when KVCANARY_HARNESS_SANITIZE=1 (set by the sanitizer test),
    gcov build when KVCANARY_HARNESS_COVERAGE=1 (set by the kernel coverage run)."""
    if os.environ.get("KVCANARY_HARNESS_SANITIZE") == "1":
        return SANITIZE_FLAGS
    if os.environ.get("KVCANARY_HARNESS_COVERAGE") == "1":
        return COVERAGE_FLAGS
    return DEFAULT_FLAGS
