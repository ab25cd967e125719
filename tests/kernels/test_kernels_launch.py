"""The pure-Python parts of the CUDA backend that need no GPU: the by-value descriptor
layout (checked against the C struct compiled by the harness), descriptor packing, launch
geometry and argument lists."""

import numpy as np
import pytest

import kvcanary as kc
from builders import make_context, make_sources, make_verify_plan
from kernel_harness import CpuKernels, load
from kvcanary.backends.cuda import launch as L


@pytest.mark.needs_compiler
@pytest.mark.parametrize("bound", [1, 4, 8, 64])
def test_sources_dtype_matches_the_c_struct(bound):
    lib = load(bound, False)
    dtype = L.sources_dtype(bound)
    assert dtype.itemsize == lib.kvc_cpu_sources_size()
    assert dtype.fields["src"][1] == lib.kvc_cpu_sources_offset(0)
    assert dtype.fields["num_sources"][1] == lib.kvc_cpu_sources_offset(1)
    assert dtype.fields["mode"][1] == lib.kvc_cpu_sources_offset(2)
    assert dtype["src"].base.itemsize == lib.kvc_cpu_sources_offset(3)
    assert lib.kvc_cpu_max_sources() == bound


@pytest.mark.parametrize("bound", [0, 65])
def test_sources_dtype_rejects_bad_bounds(bound):
    with pytest.raises(ValueError, match="max_real_kv_sources must be in"):
        L.sources_dtype(bound)


def test_pack_sources_fields_in_order():
    sources = make_sources(3, 16, bytes_per_token=32, read_bytes=16, page_size=2, row_gap=16)
    ctx = make_context(num_slots=16, sources=sources, mode=kc.RealKvHashMode.ALL,
                       max_real_kv_sources=8)
    packed = L.pack_sources(ctx)
    assert packed["num_sources"] == 3 and packed["mode"] == int(kc.RealKvHashMode.ALL)
    for i, source in enumerate(sources):
        entry = packed["src"][i]
        assert entry["ptr"] == source.tensor.ctypes.data
        assert entry["row_stride_bytes"] == source.tensor.strides[0] == 2 * 32 + 16
        assert (entry["page_size"], entry["num_bytes_per_token"], entry["read_bytes"],
                entry["num_rows"]) == (2, 32, 16, 8)
    assert not packed["src"][3:].tobytes().strip(b"\0")
    assert len(packed.tobytes()) == 8 * 48 + 8


def test_pack_sources_without_hashing_passes_nothing():
    ctx = make_context(num_slots=16, sources=make_sources(2, 16), mode=kc.RealKvHashMode.NONE)
    packed = L.pack_sources(ctx)
    assert packed["num_sources"] == 0 and packed["mode"] == 0
    assert not packed.tobytes().strip(b"\0")


@pytest.mark.parametrize("work,sms,expected", [
    (0, 132, (1, 256)), (1, 132, (1, 256)), (256, 132, (1, 256)), (257, 132, (2, 256)),
    (1 << 20, 132, (528, 256)), (16 << 20, 132, (528, 256)), (10_000, 2, (8, 256)),
])
def test_grid_stride_geometry(work, sms, expected):
    assert L.grid_stride_geometry(work, sms) == expected


@pytest.mark.parametrize("capacity,expected", [(0, (1, 128)), (1, (1, 128)), (256, (2, 128)),
                                               (257, (3, 128))])
def test_write_geometry(capacity, expected):
    assert L.write_geometry(capacity) == expected


def test_geometry_rejects_non_positive_sizes():
    with pytest.raises(ValueError, match="multiprocessor_count=0"):
        L.grid_stride_geometry(10, 0)


@pytest.mark.needs_compiler
def test_verify_launch_spans_several_blocks_on_the_cpu():
    kernels = CpuKernels(multiprocessor_count=3, threads_per_block=8)
    ctx = make_context(num_slots=200)
    kernels.verify(ctx, make_verify_plan(list(range(1, 200)), [0] * 199, [-1] * 199),
                   check_expected_token=False)
    assert kernels.launches == [("kvc_verify", 12, 8)]
    assert int(ctx.violation_log.write_index[0]) == 199


def test_kernel_sources_inline_their_headers_once():
    text = L.kernel_source("verify")
    assert '#include "' not in text
    assert text.count("struct RealKvSources {") == 1
    assert text.count("constexpr uint64_t kCanaryChainAnchor") == 1


def test_argument_lists_use_fixed_width_scalars():
    ctx = make_context(num_slots=8)
    args = L.verify_args(ctx, make_verify_plan([1], [0], [-1]))
    assert all(isinstance(a, (np.ndarray, np.int64, np.int32, np.uint64)) for a in args)
    # The descriptor struct travels as a one-element numpy array, which every CuPy passes
    # by value; a numpy.void scalar is refused by CuPy 13.x and by 14.0 above 64 bytes.
    struct = args[-1]
    assert isinstance(struct, np.ndarray) and struct.shape == () and struct.dtype.names
    assert struct.nbytes == L.sources_dtype(ctx.max_real_kv_sources).itemsize


def test_cuda_backend_reports_no_device_here():
    from kvcanary.backends import cuda

    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        count = 0
    if count:
        pytest.skip("a CUDA device is visible; this checks the no-device path")
    with pytest.raises(cuda.CudaUnavailable, match="kv-canary:"):
        cuda.backend()
