"""Real KV of any element type enters zero-copy as its bytes: bf16, fp8 and packed fp4 from
torch (a real DLPack producer; its CPU build is enough) on the CPU, torch bf16 and fp8 on a
GPU; the same bytes give the same fingerprint whatever element type carries them."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import kvcanary as kc
from builders import (DLPackOnly, fields, make_context, make_verify_plan, make_write_plan,
                      write_tokens)
from kvcanary.audit import audit
from kvcanary.dump import load, save

torch = pytest.importorskip("torch", reason="torch (its CPU build: pip install "
                            "'torch==2.13.0+cpu') is the DLPack producer of bf16/fp8/fp4")

ALL = kc.RealKvHashMode.ALL
NUM_SLOTS, SLOT_BYTES = 16, 64
SLOTS = list(range(1, NUM_SLOTS))


def random_bytes(rows: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, width), dtype=np.uint8)


def source(tensor) -> kc.RealKvSource:
    return kc.RealKvSource(tensor, page_size=1, num_bytes_per_token=SLOT_BYTES,
                           read_bytes=SLOT_BYTES)


def fingerprints(src: kc.RealKvSource, xp=np) -> list[int]:
    """The real-KV hashes a write stores for every slot but the padding slot 0, on the
    backend of ``xp``; a verify of the same slots then finds them clean."""
    ctx = kc.CanaryContext(
        xp.zeros((NUM_SLOTS, 32), xp.uint8), kernel_kind=kc.LaunchTag.HEAD_K_FULL,
        violation_log=kc.ViolationLog.allocate(8, xp=xp),
        slot_run_counter=xp.zeros(1, xp.int64), kernel_run_counter=xp.zeros(1, xp.int64),
        real_kv_sources=[src], real_kv_hash_mode=ALL)
    positions = list(range(len(SLOTS)))
    write = make_write_plan([len(SLOTS)], [-1])
    kc.write(ctx, kc.WritePlan(*(xp.asarray(a) for a in write.arrays().values())),
             input_ids=xp.asarray(SLOTS, xp.int64), positions=xp.asarray(positions, xp.int64),
             out_cache_loc=xp.asarray(SLOTS, xp.int64))
    verify = make_verify_plan(SLOTS, positions, [-1] + SLOTS[:-1])
    kc.verify(ctx, kc.VerifyPlan(*(xp.asarray(a) for a in verify.arrays().values())))
    assert int(ctx.violation_log.write_index[0]) == 0
    canary = ctx.canary_buf if xp is np else ctx.canary_buf.get()
    return [int(v) for v in fields(canary)[SLOTS, 3]]


def torch_array(raw: np.ndarray, dtype):
    """A torch tensor of ``dtype`` whose memory holds exactly the bytes ``raw``."""
    return torch.from_numpy(np.ascontiguousarray(raw)).view(dtype)


def data_pointer(src: kc.RealKvSource) -> int:
    return int(src.tensor.__array_interface__["data"][0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16"])
def test_torch_kv_is_read_as_its_own_bytes(dtype):
    raw = random_bytes(NUM_SLOTS, SLOT_BYTES)
    kv = torch_array(raw, getattr(torch, dtype))
    src = source(kv)
    assert src.tensor.dtype == np.uint8 and src.tensor.shape == (NUM_SLOTS, SLOT_BYTES)
    assert data_pointer(src) == kv.data_ptr()  # no copy
    assert np.array_equal(src.tensor, raw)
    assert fingerprints(src) == fingerprints(source(raw.copy()))
    assert any(fingerprints(src))


def test_packed_fp4_rows_are_their_packed_bytes():
    # Two e2m1 codes per byte, the first in the low nibble (DLPack's packing of sub-byte types).
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip(f"torch {torch.__version__} has no packed 4-bit float type (fp4, two per "
                    "byte): a newer torch has it")
    codes = np.random.default_rng(1).integers(0, 16, (NUM_SLOTS, 2 * SLOT_BYTES), np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    kv = torch_array(packed, torch.float4_e2m1fn_x2)
    src = source(kv)
    assert np.array_equal(src.tensor, packed)
    assert fingerprints(src) == fingerprints(source(packed))


def test_a_wide_row_stride_is_honoured_without_a_copy():
    # Each row of 32 bf16 values is followed by 16 foreign values (rows wider than the slots).
    raw = random_bytes(NUM_SLOTS, SLOT_BYTES + 32, seed=2)
    rows = raw.view(np.uint16)[:, : SLOT_BYTES // 2]
    bf16_rows = torch.from_numpy(raw).view(torch.bfloat16)[:, : SLOT_BYTES // 2]
    for given in (DLPackOnly(rows), bf16_rows):
        src = source(given)
        assert src.row_stride_bytes == SLOT_BYTES + 32 and src.row_bytes == SLOT_BYTES
        assert np.shares_memory(src.tensor, raw)
        assert fingerprints(src) == fingerprints(source(raw[:, :SLOT_BYTES].copy()))


def test_the_producers_buffer_outlives_its_array():
    raw = random_bytes(64, 4096, seed=3)  # large enough to be released to the system
    kv = torch_array(raw.copy(), torch.bfloat16)
    src = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=4096, read_bytes=4096)
    del kv
    gc.collect()
    others = [torch.full((64, 2048), 7, dtype=torch.bfloat16) + i for i in range(32)]  # reuse
    assert np.array_equal(src.tensor, raw)
    del others


def test_a_type_without_numbers_is_refused_by_name_where_numbers_are_needed():
    table = torch.zeros((2, 8), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^kv-canary: req_to_token has element type bfloat16"):
        kc.plan(req_pool_indices=np.array([1]), prefix_lens=np.array([0]),
                extend_seq_lens=np.array([1]), req_to_token=table,
                verify_plan=kc.VerifyPlan.allocate(4), write_plan=kc.WritePlan.allocate(1))
    with pytest.raises(ValueError, match=r"^kv-canary: input_ids has element type float8_e4m3fn"):
        kc.write(make_context(), kc.WritePlan.allocate(1),
                 input_ids=torch.zeros(1, dtype=torch.float8_e4m3fn),
                 positions=np.zeros(1, np.int64), out_cache_loc=np.zeros(1, np.int64))


@pytest.mark.parametrize("container", ["d.npz", "d.safetensors", "d"])
@pytest.mark.parametrize("producer", [lambda kv: kv, DLPackOnly], ids=["torch", "dlpack-only"])
def test_dump_save_keeps_the_bytes_of_bf16_kv(tmp_path, container, producer):
    # torch's bf16 is a tensor numpy cannot convert: only DLPack reads it
    raw = random_bytes(NUM_SLOTS, SLOT_BYTES, seed=4)
    ctx = make_context(num_slots=NUM_SLOTS, sources=[source(raw)], mode=ALL)
    write_tokens(ctx, SLOTS, SLOTS, list(range(len(SLOTS))))
    table = np.zeros((2, NUM_SLOTS), np.int32)
    table[1, : len(SLOTS)] = SLOTS
    arrays = dict(canary=ctx.canary_buf, req_to_token=table,
                  req_pool_indices=np.array([1], np.int64),
                  seq_lens=np.array([len(SLOTS)], np.int64), real_kv_hash_mode="all",
                  real_kv_params=np.array([[1, SLOT_BYTES, SLOT_BYTES]], np.int64))

    def dumped(kv_bytes):
        kv = producer(torch_array(kv_bytes.copy(), torch.bfloat16))
        return load(save(str(tmp_path / container), real_kv_0=kv, **arrays))

    dump = dumped(raw)
    assert np.array_equal(dump.real_kv[0].reshape(NUM_SLOTS, -1), raw)
    assert audit(dump, backend="numpy").clean
    raw[5, 0] ^= 1  # the same dump with one KV byte changed is caught
    assert not audit(dumped(raw), backend="numpy").clean


# ------------------------------------------------------------------ GPU (torch on a device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_torch_device_kv_is_read_as_its_own_bytes(dtype):
    from kernel_harness.gpu import require_gpu

    cupy = require_gpu()
    raw = torch.from_numpy(random_bytes(NUM_SLOTS, SLOT_BYTES, seed=5)).cuda()
    kv = raw.view(getattr(torch, dtype))
    try:
        torch.utils.dlpack.to_dlpack(kv)
    except Exception as exc:  # older torch exports no float8 through DLPack
        pytest.skip(f"torch {torch.__version__} cannot export {dtype.replace('_', ' ')} "
                    f"through DLPack ({type(exc).__name__}): a newer torch can")
    src = source(kv)
    assert int(src.tensor.data.ptr) == kv.data_ptr()  # no copy
    as_bytes = source(cupy.asarray(raw))
    strided = torch.zeros(NUM_SLOTS, SLOT_BYTES + 32, dtype=torch.uint8, device="cuda")
    strided[:, :SLOT_BYTES] = raw
    wide = source(strided.view(getattr(torch, dtype))[:, : SLOT_BYTES // kv.element_size()])
    assert wide.row_stride_bytes == SLOT_BYTES + 32
    hashes = [fingerprints(s, cupy) for s in (src, as_bytes, wide)]
    assert hashes[0] == hashes[1] == hashes[2] == fingerprints(source(raw.cpu().numpy()))


def test_a_tensor_on_the_meta_device_is_one_error_naming_the_argument(tmp_path):
    # torch's meta device holds no data and DLPack has no device type for it.
    meta = torch.zeros(4, 64, dtype=torch.uint8, device="meta")
    with pytest.raises(kc.CanaryError, match=r"^kv-canary: req_pool_indices is a Tensor on "
                       r"device meta, which DLPack cannot share") as caught:
        kc.plan(req_pool_indices=torch.zeros(1, dtype=torch.int64, device="meta"),
                prefix_lens=np.zeros(1, np.int64), extend_seq_lens=np.zeros(1, np.int64),
                req_to_token=np.zeros((2, 4), np.int32), verify_plan=kc.VerifyPlan.allocate(4),
                write_plan=kc.WritePlan.allocate(1))
    assert caught.value.key == "req_pool_indices"
    with pytest.raises(kc.CanaryError, match=r"^kv-canary: RealKvSource.tensor is a Tensor on "
                       r"device meta") as caught:
        kc.RealKvSource(meta, page_size=1, num_bytes_per_token=64, read_bytes=64)
    from kvcanary.dump import save

    with pytest.raises(ValueError, match=r"key canary: canary is a Tensor on device meta"):
        save(str(tmp_path / "meta.npz"), canary=meta)
    assert not (tmp_path / "meta.npz").exists()
