"""The real-KV fingerprint (docs/format.md §5): layouts, modes and widths, through kc.write."""

import copy
import pickle

import numpy as np
import pytest

import kvcanary as kc
import oracle
from builders import fields, make_context, make_sources, source_slot_bytes, write_tokens

ALL, PARTIAL, NONE = kc.RealKvHashMode.ALL, kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.NONE


def stored_hashes(sources, mode, slots, num_slots):
    ctx = make_context(num_slots=num_slots, sources=sources, mode=mode)
    write_tokens(ctx, slots, list(range(len(slots))), list(range(len(slots))))
    return [int(v) for v in fields(ctx.canary_buf)[slots, 3]]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("row_gap", [0, 32])
@pytest.mark.parametrize("mode", [PARTIAL, ALL])
def test_layouts_equal_oracle(page_size, row_gap, mode):
    num_slots = 48
    sources = make_sources(3, num_slots, bytes_per_token=64, read_bytes=48, page_size=page_size,
                           row_gap=row_gap, fill="random", seed=page_size + row_gap)
    slots = list(range(1, num_slots))
    assert stored_hashes(sources, mode, slots, num_slots) == [
        oracle.real_kv(sources, int(mode), s) for s in slots]


def test_partial_reads_16_bytes_whatever_read_bytes_says():
    src = make_sources(1, 8, bytes_per_token=64, read_bytes=64, fill="random")[0]
    before = stored_hashes([src], PARTIAL, [2], 8)
    source_slot_bytes(src, 2)[16:] ^= 0xFF
    assert stored_hashes([src], PARTIAL, [2], 8) == before
    source_slot_bytes(src, 2)[0] ^= 1
    assert stored_hashes([src], PARTIAL, [2], 8) != before


def test_all_reads_exactly_read_bytes():
    src = make_sources(1, 8, bytes_per_token=64, read_bytes=32, fill="random")[0]
    before = stored_hashes([src], ALL, [2], 8)
    source_slot_bytes(src, 2)[32:] ^= 0xFF
    assert stored_hashes([src], ALL, [2], 8) == before
    source_slot_bytes(src, 2)[31] ^= 1
    assert stored_hashes([src], ALL, [2], 8) != before


def test_neighbouring_slots_and_holes_are_not_read():
    sources = make_sources(1, 16, bytes_per_token=16, page_size=4, row_gap=16, fill="random")
    src = sources[0]
    before = stored_hashes(sources, ALL, [5], 16)
    source_slot_bytes(src, 4)[:] ^= 0xFF
    source_slot_bytes(src, 6)[:] ^= 0xFF
    src.tensor.base[1, 64:] ^= 0xFF  # the hole after row 1 (slots 4..7)
    assert stored_hashes(sources, ALL, [5], 16) == before


def test_zero_bytes_hash_to_zero_and_none_mode_stores_zero():
    zero = kc.RealKvSource(np.zeros((8, 32), np.uint8), page_size=1, num_bytes_per_token=32,
                           read_bytes=32)
    assert stored_hashes([zero, zero], ALL, [1, 2], 8) == [0, 0]
    rnd = make_sources(2, 8, fill="random")
    assert stored_hashes(rnd, NONE, [1, 2], 8) == [0, 0]


def test_wider_dtypes_and_strided_views_read_the_same_bytes():
    base = np.random.default_rng(5).integers(0, 256, size=(8, 64), dtype=np.uint8)
    as_bytes = kc.RealKvSource(base[:, :32], page_size=1, num_bytes_per_token=32, read_bytes=32)
    as_f32 = kc.RealKvSource(base.view(np.float32)[:, :8], page_size=1, num_bytes_per_token=32,
                             read_bytes=32)
    as_i64 = kc.RealKvSource(base.view(np.int64)[:, :4], page_size=1, num_bytes_per_token=32,
                             read_bytes=32)
    slots = [1, 2, 7]
    want = stored_hashes([as_bytes], ALL, slots, 8)
    assert stored_hashes([as_f32], ALL, slots, 8) == want
    assert stored_hashes([as_i64], ALL, slots, 8) == want


def test_many_slots_cross_the_gather_chunk():
    num_slots = 70_000
    src = make_sources(1, num_slots, fill="random", seed=9)[0]
    slots = np.arange(num_slots, dtype=np.int64)
    ctx = make_context(num_slots=num_slots, sources=[src], mode=ALL)
    plan = kc.WritePlan(write_offsets=np.array([0, num_slots], np.int64),
                        write_seed_slot_indices=np.array([-1], np.int64),
                        write_num_valid_reqs=np.ones(1, np.int32))
    kc.write(ctx, plan, input_ids=slots, positions=slots, out_cache_loc=slots)
    got = fields(ctx.canary_buf)[:, 3]
    for s in (0, 1, 65_535, 65_536, 69_999):
        assert int(got[s]) == oracle.real_kv([src], int(ALL), s)


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.int32, np.float32])
@pytest.mark.parametrize("row_gap", [0, 32])
@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))],
                         ids=["deepcopy", "pickle"])
def test_a_copied_source_hashes_what_its_copied_producer_holds(dtype, row_gap, copy_of):
    # An engine state copied whole (producer tensor and source together) must keep them one
    # buffer: the bytes written through the producer's copy are the bytes the copy hashes.
    backing = np.random.default_rng(4).integers(0, 256, (8, 64 + row_gap), dtype=np.uint8)
    kv = backing.view(dtype)[:, : 64 // np.dtype(dtype).itemsize]
    src = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=64, read_bytes=64)
    kv_copy, src_copy = copy_of((kv, src))
    assert np.shares_memory(src_copy.tensor, kv_copy)
    assert not np.shares_memory(src_copy.tensor, backing)
    before = stored_hashes([src_copy], ALL, [3], 8)
    kv_copy[3] = 0
    fresh = kc.RealKvSource(kv_copy, page_size=1, num_bytes_per_token=64, read_bytes=64)
    assert stored_hashes([src_copy], ALL, [3], 8) == stored_hashes([fresh], ALL, [3], 8)
    assert stored_hashes([src_copy], ALL, [3], 8) != before
    assert stored_hashes([src], ALL, [3], 8) == before  # the original keeps its own bytes
