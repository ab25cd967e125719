"""The CUDA backend: ``plan``, ``write`` and ``verify`` on cupy arrays.

The arguments arrive already validated by ``kvcanary.api``. Each launch is described
once, as an ordered argument list (:func:`verify_args`, :func:`write_args`,
:func:`plan_offsets_args`, :func:`plan_entries_args`), which is library-neutral: the
GPU path hands it to a ``cupy.RawModule`` function, and the CPU test harness hands the
same list to the same kernel source compiled by g++. Module compilation, descriptor
packing, option building and grid sizing are plain functions that need no GPU.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from ...model import arrays as A
from ...format.consts import RealKvHashMode
from ...model.arrays import context_arrays
from ...format.errors import CanaryError, CanaryRuntimeError
from ..kernel_source import kernel_dir
from ...model.types import check_source_bound as check_bound

# Kernel source file and entry points of each launch.
KERNEL_FILES = {
    "verify": ("kvc_verify.cu", ("kvc_verify",)),
    "write": ("kvc_write.cu", ("kvc_write_seeds", "kvc_write_claims", "kvc_write",
                               "kvc_write_real_kv")),
    "plan": ("kvc_plan.cu", ("kvc_plan_rows", "kvc_plan_offsets", "kvc_plan_entries")),
}
CXX_STANDARD = "c++17"

# Launch geometry: persistent grid-stride kernels get BLOCKS_PER_SM blocks per
# multiprocessor of THREADS_PER_BLOCK threads, capped by the work; write runs one
# thread per request.
THREADS_PER_BLOCK = 256
BLOCKS_PER_SM = 4
WRITE_THREADS_PER_BLOCK = 128


# ---------------------------------------------------------------------------------------
# Compile settings (shared with the NVRTC compile check and the CPU harness)


def compile_defines(kernel: str, max_real_kv_sources: int | None,
                    check_expected_token: bool = False) -> list[tuple[str, str]]:
    """The ``-D`` macros of one module variant. ``max_real_kv_sources=None`` leaves the
    bound undefined (only the compile check does that, to see the #error)."""
    if kernel not in KERNEL_FILES:
        raise CanaryError(f"kernel must be one of {', '.join(KERNEL_FILES)}, got {kernel!r}",
                          key="kernel")
    defines = []
    if max_real_kv_sources is not None:
        defines.append(("KVC_MAX_REAL_KV_SOURCES", str(int(max_real_kv_sources))))
    if kernel == "verify":
        defines.append(("KVC_CHECK_VERIFY_EXPECTED_TOKEN", "1" if check_expected_token else "0"))
    return defines


def compile_options(kernel: str, max_real_kv_sources: int | None,
                    check_expected_token: bool = False) -> tuple[str, ...]:
    """NVRTC command-line options of one module variant (what ``cupy.RawModule`` gets). No
    include path: :func:`kernel_source` inlines every local header, so the options and the
    code, cupy's cache key, do not depend on where kvcanary is installed."""
    options = [f"-std={CXX_STANDARD}"]
    options += [f"-D{name}={value}" for name, value in
                compile_defines(kernel, max_real_kv_sources, check_expected_token)]
    return tuple(options)


def variant_name(kernel: str, max_real_kv_sources: int | None,
                 check_expected_token: bool = False) -> str:
    """The readable name of one compiled module: ``verify_n4_tok1`` (kernel, source-count
    bound, expected-token check), ``write_n4``, ``plan``."""
    name = kernel if kernel == "plan" else f"{kernel}_n{max_real_kv_sources}"
    return name + (f"_tok{int(check_expected_token)}" if kernel == "verify" else "")


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def expand_source(name: str) -> str:
    """The kernel file with its local ``#include "..."`` headers inlined once each, so
    the compiled text (and cupy's cache key) covers every header it depends on."""
    directory = kernel_dir()
    seen: set[str] = set()

    def expand(file_name: str) -> str:
        if file_name in seen:
            return ""
        seen.add(file_name)
        text = (directory / file_name).read_text(encoding="utf-8")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


def kernel_source(kernel: str) -> str:
    return expand_source(KERNEL_FILES[kernel][0])


# ---------------------------------------------------------------------------------------
# Real-KV descriptors, passed by value as ``kvc::RealKvSources``


@functools.lru_cache(maxsize=None)
def sources_dtype(max_real_kv_sources: int) -> np.dtype:
    """numpy layout of ``struct RealKvSources`` (kernels/kvc_realkv.cuh) for bound N:
    N descriptors of six 8-byte fields, then two int32."""
    bound = check_bound(max_real_kv_sources)
    source = np.dtype([("ptr", "<u8"), ("row_stride_bytes", "<i8"), ("page_size", "<i8"),
                       ("num_bytes_per_token", "<i8"), ("read_bytes", "<i8"),
                       ("num_rows", "<i8")], align=True)
    return np.dtype([("src", source, (bound,)), ("num_sources", "<i4"), ("mode", "<i4")],
                    align=True)


def array_pointer(array) -> int:
    """Address of an array's first element (numpy or cupy)."""
    if array is None:
        return 0
    if isinstance(array, np.ndarray):
        return int(array.ctypes.data)
    return int(array.data.ptr)


def pack_sources(context) -> np.ndarray:
    """The by-value descriptor struct of a launch, as a read-only 0-d structured array:
    CuPy passes a one-element numpy array by value on every version (a ``numpy.void``
    scalar is refused by 13.x and by 14.0 above 64 bytes). Without hashing (mode NONE or
    no sources) num_sources is 0 and mode NONE, so no descriptor is ever dereferenced.
    Packed once per distinct set of descriptors: the launch path runs every step. The
    source count was checked by the launch's ``validate`` (not again here)."""
    sources = context.real_kv_sources
    if not context.hashing:
        return _packed_sources(context.max_real_kv_sources, int(RealKvHashMode.NONE), ())
    descriptors = tuple((array_pointer(s.tensor), s.row_stride_bytes, s.page_size,
                         s.num_bytes_per_token, s.read_bytes, int(s.tensor.shape[0]))
                        for s in sources)
    return _packed_sources(context.max_real_kv_sources, int(context.real_kv_hash_mode),
                           descriptors)


@functools.lru_cache(maxsize=256)
def _packed_sources(bound: int, mode: int, descriptors: tuple) -> np.ndarray:
    packed = np.zeros((), dtype=sources_dtype(bound))
    for index, descriptor in enumerate(descriptors):
        packed["src"][index] = descriptor
    packed["num_sources"] = len(descriptors)
    packed["mode"] = mode
    packed.flags.writeable = False
    return packed


# ---------------------------------------------------------------------------------------
# Launch geometry


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def grid_stride_geometry(work_items: int, multiprocessor_count: int,
                         threads_per_block: int = THREADS_PER_BLOCK,
                         blocks_per_sm: int = BLOCKS_PER_SM) -> tuple[int, int]:
    """(blocks, threads) of a persistent grid-stride launch: enough blocks to fill every
    multiprocessor, never more than the work needs, at least one."""
    if multiprocessor_count < 1 or threads_per_block < 1 or blocks_per_sm < 1:
        raise CanaryError("launch geometry needs positive sizes, got "
                          f"multiprocessor_count={multiprocessor_count}, "
                          f"threads_per_block={threads_per_block}, blocks_per_sm={blocks_per_sm}")
    blocks = min(multiprocessor_count * blocks_per_sm, _ceil_div(max(0, work_items), threads_per_block))
    return max(1, blocks), threads_per_block


def write_geometry(write_req_capacity: int,
                   threads_per_block: int = WRITE_THREADS_PER_BLOCK) -> tuple[int, int]:
    """One thread per request slot of the plan (at least one block: the launch always
    counts itself)."""
    return max(1, _ceil_div(max(0, write_req_capacity), threads_per_block)), threads_per_block


# ---------------------------------------------------------------------------------------
# Argument lists, in each kernel's parameter order. Arrays stay arrays; scalars are
# numpy scalars of the parameter's width; null pointers are np.uint64(0).

_NULL = np.uint64(0)


# numpy scalars are immutable, so the few distinct sizes a launch passes are made once.
@functools.lru_cache(maxsize=4096)
def _i64(value: int) -> np.int64:
    return np.int64(value)


@functools.lru_cache(maxsize=64)
def _i32(value: int) -> np.int32:
    return np.int32(value)


def _or_null(array):
    return _NULL if array is None else array


def _ring_args(context) -> list:
    log = context.violation_log
    return [log.ring, _i64(log.ring.shape[0]), log.write_index]


def verify_args(context, plan) -> list:
    return [
        *_buffer_args(context),
        plan.verify_slot_indices, plan.verify_expected_tokens, plan.verify_expected_positions,
        plan.verify_prev_slot_indices, plan.verify_num_valid, plan.enable,
        _i64(plan.verify_capacity), _i64(context.kernel_kind),
        *_ring_args(context),
        context.slot_run_counter, context.kernel_run_counter,
        pack_sources(context),
    ]


def _buffer_args(context) -> list:
    buf = context.canary_buf
    return [buf, _i64(buf.shape[0]), _i64(buf.shape[1])]


def _batch_args(plan, out_cache_loc) -> list:
    return [plan.write_offsets, plan.write_num_valid_reqs, _i64(plan.write_req_capacity),
            out_cache_loc, _i64(out_cache_loc.shape[0])]


def write_seeds_args(context, plan, *, out_cache_loc) -> list:
    return [
        *_buffer_args(context),
        plan.write_offsets, plan.write_seed_slot_indices, plan.write_num_valid_reqs,
        _i64(plan.write_req_capacity), out_cache_loc, _i64(out_cache_loc.shape[0]),
        plan.seed_links_scratch, plan.seed_positions_scratch,
    ]


def write_claims_args(context, plan, *, out_cache_loc) -> list:
    return [*_buffer_args(context), *_batch_args(plan, out_cache_loc)]


def write_args(context, plan, *, input_ids, positions, out_cache_loc,
               expected_input_tokens=None, expected_input_positions=None) -> list:
    return [
        *_buffer_args(context),
        plan.write_offsets, plan.write_seed_slot_indices, plan.write_num_valid_reqs,
        _i64(plan.write_req_capacity),
        input_ids, positions, out_cache_loc, _i64(input_ids.shape[0]),
        _or_null(expected_input_tokens), _or_null(expected_input_positions),
        _i64(context.kernel_kind),
        *_ring_args(context),
        context.slot_run_counter, context.kernel_run_counter,
        context.enable_chain_position_assert, _i32(1 if context.extensions else 0),
        plan.seed_links_scratch, plan.seed_positions_scratch,
        pack_sources(context),
    ]


def write_real_kv_args(context, plan, *, out_cache_loc) -> list:
    return [*_buffer_args(context), *_batch_args(plan, out_cache_loc), pack_sources(context)]


def _table_args(table) -> list:
    if table is None:
        return [_NULL, _i64(0), _i64(0), _i32(0)]
    return [table, _i64(table.shape[0]), _i64(table.shape[1]), _i32(table.dtype.itemsize)]


def _lut_args(lut) -> list:
    return [_NULL, _i64(0)] if lut is None else [lut, _i64(lut.shape[0])]


def plan_rows_args(*, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, block_size,
                   full_to_swa_index_mapping, swa_window_size, verify_plan, write_plan,
                   verify_offsets_scratch) -> list:
    return [
        req_pool_indices, prefix_lens, extend_seq_lens, _i64(req_pool_indices.shape[0]),
        *_table_args(req_to_token), _i64(block_size),
        *_lut_args(full_to_swa_index_mapping), _i64(swa_window_size),
        verify_offsets_scratch, _i64(verify_plan.verify_capacity),
        write_plan.write_offsets, _i64(write_plan.write_req_capacity),
        write_plan.write_seed_slot_indices,
    ]


def plan_offsets_args(*, bs, verify_plan, write_plan, verify_offsets_scratch) -> list:
    return [
        _i64(bs), verify_offsets_scratch, _i64(verify_plan.verify_capacity),
        verify_plan.verify_num_valid, verify_plan.enable, write_plan.write_offsets,
        write_plan.write_num_valid_reqs,
    ]


def plan_entries_args(*, req_pool_indices, prefix_lens, req_to_token, block_size,
                      full_to_swa_index_mapping, swa_window_size, req_to_verify_expected_tokens,
                      req_to_verify_expected_tokens_valid_lens, kv_token_id_vs_position_offset,
                      verify_plan, verify_offsets_scratch) -> list:
    return [
        req_pool_indices, prefix_lens, _i64(req_pool_indices.shape[0]),
        *_table_args(req_to_token), _i64(block_size),
        *_lut_args(full_to_swa_index_mapping), _i64(swa_window_size),
        *_table_args(req_to_verify_expected_tokens),
        _or_null(req_to_verify_expected_tokens_valid_lens), _i64(kv_token_id_vs_position_offset),
        verify_offsets_scratch, _i64(verify_plan.verify_capacity),
        verify_plan.verify_slot_indices, verify_plan.verify_expected_tokens,
        verify_plan.verify_expected_positions, verify_plan.verify_prev_slot_indices,
    ]


class Launcher:
    """Runs the launches given a way to run one kernel: ``run(kernel_file_key, name,
    (blocks, threads), args)``. The GPU backend and the CPU harness both use it, so the
    launch sequence itself is what the CPU tests exercise."""

    def __init__(self, run, multiprocessor_count: int, *, threads_per_block: int = THREADS_PER_BLOCK,
                 write_threads_per_block: int = WRITE_THREADS_PER_BLOCK):
        self._run = run
        self.multiprocessor_count = int(multiprocessor_count)
        self.threads_per_block = threads_per_block
        self.write_threads_per_block = write_threads_per_block

    def _grid(self, work_items: int) -> tuple[int, int]:
        return grid_stride_geometry(work_items, self.multiprocessor_count, self.threads_per_block)

    def verify(self, context, plan, *, check_expected_token: bool) -> None:
        self._run(("verify", context.max_real_kv_sources, bool(check_expected_token)), "kvc_verify",
                  self._grid(plan.verify_capacity), verify_args(context, plan))

    def write(self, context, plan, *, input_ids, positions, out_cache_loc,
              expected_input_tokens=None, expected_input_positions=None) -> None:
        # Four launches, so that the result does not depend on thread order: seeds read
        # (and claim words cleared) before any slot is claimed, claims complete before any
        # record is stored, the real-KV hash stored last over the claim word.
        key = ("write", context.max_real_kv_sources, False)
        grid = write_geometry(plan.write_req_capacity, self.write_threads_per_block)
        self._run(key, "kvc_write_seeds", grid,
                  write_seeds_args(context, plan, out_cache_loc=out_cache_loc))
        self._run(key, "kvc_write_claims", grid,
                  write_claims_args(context, plan, out_cache_loc=out_cache_loc))
        self._run(key, "kvc_write", grid, write_args(
            context, plan, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
            expected_input_tokens=expected_input_tokens,
            expected_input_positions=expected_input_positions))
        self._run(key, "kvc_write_real_kv", grid,
                  write_real_kv_args(context, plan, out_cache_loc=out_cache_loc))

    def plan(self, *, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, verify_plan,
             write_plan, swa_window_size=0, full_to_swa_index_mapping=None,
             req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
             kv_token_id_vs_position_offset=0, block_size=1) -> None:
        """``req_to_token`` is the slot table: per-token, or a block table when
        ``block_size`` is above 1."""
        bs = int(req_pool_indices.shape[0])
        scratch = write_plan.plan_offsets_scratch  # bs + 1 <= write_req_capacity + 1 entries
        key = ("plan", None, False)
        common = dict(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
                      req_to_token=req_to_token, block_size=block_size,
                      full_to_swa_index_mapping=full_to_swa_index_mapping,
                      swa_window_size=swa_window_size, verify_offsets_scratch=scratch)
        rows_work = max(bs, write_plan.write_req_capacity + 1)
        self._run(key, "kvc_plan_rows", self._grid(rows_work), plan_rows_args(
            extend_seq_lens=extend_seq_lens, verify_plan=verify_plan, write_plan=write_plan,
            **common))
        self._run(key, "kvc_plan_offsets", (1, 1), plan_offsets_args(
            bs=bs, verify_plan=verify_plan, write_plan=write_plan, verify_offsets_scratch=scratch))
        if bs == 0:
            return
        self._run(key, "kvc_plan_entries", self._grid(verify_plan.verify_capacity),
                  plan_entries_args(
                      req_to_verify_expected_tokens=req_to_verify_expected_tokens,
                      req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
                      kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
                      verify_plan=verify_plan, **common))


# ---------------------------------------------------------------------------------------
# GPU side (imported only once cupy saw a device)


COMPILED: list = []     # variant names compiled in this process, in order


@functools.lru_cache(maxsize=None)
def module(kernel: str, max_real_kv_sources: int | None, check_expected_token: bool):
    """One compiled ``cupy.RawModule`` per (kernel, bound, variant); a compile error names the
    variant (:func:`variant_name`)."""
    import cupy

    bound = None if kernel == "plan" else check_bound(max_real_kv_sources)
    name = variant_name(kernel, bound, check_expected_token)
    options = compile_options(kernel, bound, check_expected_token)
    try:
        compiled = cupy.RawModule(code=kernel_source(kernel), options=options)
        for entry in KERNEL_FILES[kernel][1]:    # RawModule compiles lazily: compile now
            compiled.get_function(entry)
    except Exception as exc:  # cupy's CompileException, or a driver error
        raise CanaryRuntimeError(f"kernel variant {name} did not compile "
                                 f"({' '.join(options)}): {exc}") from exc
    COMPILED.append(name)
    return compiled


@functools.lru_cache(maxsize=None)
def kernel_function(kernel: str, max_real_kv_sources: int | None, check_expected_token: bool,
                    name: str):
    """One entry point of a module, looked up once (cupy loads it per device itself)."""
    return module(kernel, max_real_kv_sources, check_expected_token).get_function(name)


def _gpu_run(key, name, geometry, args) -> None:
    blocks, threads = geometry
    kernel_function(*key, name)((blocks,), (threads,), tuple(args))


@functools.lru_cache(maxsize=None)
def _launcher(device_id: int) -> Launcher:
    import cupy

    count = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
    return Launcher(_gpu_run, count)


def launch_device(arrays, named) -> int:
    """The one device every array of a launch lives on (``arrays``: cupy arrays or None);
    when they differ, an error naming two of them from ``named()`` (name -> array, the
    canary buffer or the plan output first)."""
    devices = {array.data.device_id for array in arrays if array is not None}
    if len(devices) == 1:
        return devices.pop()
    where = [(name, array.data.device_id) for name, array in named().items() if array is not None]
    first_name, device = where[0]
    name, here = next((name, here) for name, here in where if here != device)
    raise CanaryError(
        f"{name} is on GPU {here} but {first_name} is on GPU {device}; "
        "every array of a launch must live on the canary buffer's device", key=name)


def _on_device(device_id: int, launch) -> None:
    """Run ``launch(launcher)`` with ``device_id`` current (cupy launches on the current
    device and its current stream)."""
    import cupy

    if cupy.cuda.runtime.getDevice() == device_id:
        launch(_launcher(device_id))
        return
    with cupy.cuda.Device(device_id):
        launch(_launcher(device_id))


def verify(context, plan, *, check_expected_token: bool) -> None:
    device = launch_device(
        (*context_arrays(context).values(), *plan.arrays().values()),
        lambda: {**context_arrays(context), **plan.arrays()})
    _on_device(device, lambda launcher: launcher.verify(
        context, plan, check_expected_token=check_expected_token))


def write(context, plan, *, input_ids, positions, out_cache_loc, expected_input_tokens=None,
          expected_input_positions=None) -> None:
    tokens = {"input_ids": input_ids, "positions": positions, "out_cache_loc": out_cache_loc,
              "expected_input_tokens": expected_input_tokens,
              "expected_input_positions": expected_input_positions}
    device = launch_device(
        (*context_arrays(context).values(), plan.write_offsets, plan.write_seed_slot_indices,
         plan.write_num_valid_reqs, *tokens.values()),
        lambda: {**context_arrays(context), **plan.arrays(), **tokens})
    _on_device(device, lambda launcher: launcher.write(context, plan, **tokens))


def plan(**kwargs) -> None:
    verify_plan, write_plan = kwargs["verify_plan"], kwargs["write_plan"]
    outputs = {**verify_plan.arrays(), **write_plan.arrays()}
    inputs = {name: value for name, value in kwargs.items() if A.is_cupy_array(value)}
    device = launch_device((*outputs.values(), *inputs.values()), lambda: {**outputs, **inputs})
    _on_device(device, lambda launcher: launcher.plan(**kwargs))
