"""The chunked hot paths across their chunk edges: the vectorised chain link hashes
``hashing.BLOCK_ENTRIES`` entries at a time and the real-KV fold gathers
``realkv.CHUNK_SLOTS`` slots at a time. Each size is shrunk (it is read at call time) so
small buffers cross many edges; one clean run at the real sizes crosses the first edge.
The real-KV tests run the numpy fold (the compiled one, where numba is installed, has no
chunks: tests/reference/test_realkv_compiled.py).
A clean buffer verifies clean, and a fault planted on either side of an edge is reported
at exactly that slot."""

import numpy as np
import pytest

import kvcanary as kc
from builders import i64, make_context, make_sources, make_verify_plan, ring_rows, source_slot_bytes, write_tokens
from kvcanary.format import hashing
from kvcanary.backends.reference import realkv, realkv_compiled
from oracle import mix3, real_kv

F = kc.FailReason
ALL = kc.RealKvHashMode.ALL


def _edges(block: int, length: int) -> list[int]:
    """Indices on both sides of every block edge below ``length``, plus both ends."""
    picks = {0, length - 1}
    for edge in range(block, length, block):
        picks.update({edge - 1, edge})
    return sorted(picks)


def _chain(ctx, n: int):
    """One request of ``n`` tokens written to entries 0..n-1 (slot = entry + 1: slot 0 is
    the padding slot, never checked); its verify plan."""
    slots = np.arange(1, n + 1)
    write_tokens(ctx, slots, (slots * 7 + 3) % 1000, slots - 1)
    return make_verify_plan(slots, slots - 1, np.concatenate([[-1], slots[:-1]]))


@pytest.mark.parametrize("block", [1, 2, 3, 8])
@pytest.mark.parametrize("length", [7, 8, 9, 17])
def test_link_inplace_equals_the_scalar_link_for_every_entry(monkeypatch, block, length):
    monkeypatch.setattr(hashing, "BLOCK_ENTRIES", block)
    rng = np.random.default_rng(block * 100 + length)
    prev, token, position = (rng.integers(0, 2**63, size=length, dtype=np.uint64)
                             for _ in range(3))
    got = hashing.link_inplace(prev.copy(), token, position)
    want = [mix3(int(p), int(t), int(q)) for p, t, q in zip(prev, token, position)]
    assert [int(v) for v in got] == want


@pytest.mark.parametrize("block", [2, 5])
def test_clean_chain_across_hash_blocks_verifies_clean(monkeypatch, block):
    monkeypatch.setattr(hashing, "BLOCK_ENTRIES", block)
    ctx = make_context(num_slots=24)
    kc.verify(ctx, _chain(ctx, 23))
    assert ring_rows(ctx) == []


@pytest.mark.parametrize("block", [2, 5])
def test_fault_beside_a_hash_block_edge_is_reported_at_that_slot(monkeypatch, block):
    monkeypatch.setattr(hashing, "BLOCK_ENTRIES", block)
    for slot in _edges(block, 23):
        ctx = make_context(num_slots=24)
        plan = _chain(ctx, 23)
        ctx.canary_buf.view("<i8")[slot + 1, 2] ^= 1  # the stored link of entry `slot`
        kc.verify(ctx, plan)
        # `slot` holds a wrong link, and the link it hands its successor changes too
        assert [(row[1], row[7]) for row in ring_rows(ctx)] == [
            (s + 1, int(F.VERIFY_CHAIN_HASH_MISMATCH)) for s in (slot, slot + 1) if s < 23], slot


def test_clean_chain_past_the_real_hash_block_verifies_clean():
    n = hashing.BLOCK_ENTRIES + 3
    ctx = make_context(num_slots=n + 1)
    plan = _chain(ctx, n)
    kc.verify(ctx, plan)
    assert ring_rows(ctx) == []
    edge = hashing.BLOCK_ENTRIES  # entry 65,536 is slot 65,537
    ctx.canary_buf.view("<i8")[edge + 1, 2] ^= 1
    kc.verify(ctx, plan)
    assert [row[1] for row in ring_rows(ctx)] == [edge + 1, edge + 2]


# ------------------------------------------------------------------ real-KV chunks

@pytest.fixture
def numpy_fold(monkeypatch):
    monkeypatch.setattr(realkv_compiled, "ENABLED", False)


def _sources(n: int, page_size: int = 1):
    return make_sources(2, n, bytes_per_token=32, page_size=page_size, fill="random", seed=n)


@pytest.mark.parametrize("chunk", [1, 3, 4])
@pytest.mark.parametrize("page_size", [1, 4])
def test_real_kv_hash_equals_the_per_slot_fold(monkeypatch, numpy_fold, chunk, page_size):
    monkeypatch.setattr(realkv, "CHUNK_SLOTS", chunk)
    sources = _sources(13, page_size)
    slots = np.random.default_rng(chunk).permutation(13)
    got = realkv.real_kv_hash(sources, ALL, slots)
    want = [real_kv(sources, int(ALL), int(slot)) for slot in slots]
    assert [hashing.to_signed(int(v)) for v in got] == want


@pytest.mark.parametrize("chunk_bytes", [1, 100, 1 << 25])
def test_many_sources_of_mixed_widths_fold_side_by_side_as_one_at_a_time(monkeypatch, numpy_fold,
                                                                        chunk_bytes):
    # Sources of one read width fold together (K and V of every layer); their order in the
    # fingerprint stays the source order, whatever the grouping and the byte budget.
    monkeypatch.setattr(realkv, "CHUNK_BYTES", chunk_bytes)
    wide = make_sources(3, 11, bytes_per_token=48, page_size=2, fill="random", seed=1)
    narrow = make_sources(2, 11, bytes_per_token=32, read_bytes=16, page_size=2,
                          fill="random", seed=2)
    sources = [wide[0], narrow[0], wide[1], narrow[1], wide[2]]
    slots = np.random.default_rng(3).permutation(11)
    for mode in (ALL, kc.RealKvHashMode.PARTIAL):
        got = realkv.real_kv_hash(sources, mode, slots)
        want = [real_kv(sources, int(mode), int(slot)) for slot in slots]
        assert [hashing.to_signed(int(v)) for v in got] == want


@pytest.mark.parametrize("chunk", [2, 5])
def test_real_kv_fault_beside_a_chunk_edge_is_reported_at_that_slot(monkeypatch, numpy_fold, chunk):
    monkeypatch.setattr(realkv, "CHUNK_SLOTS", chunk)
    n = 17
    for slot in _edges(chunk, n):
        sources = _sources(n + 1)
        ctx = make_context(num_slots=n + 1, sources=sources, mode=ALL)
        plan = _chain(ctx, n)
        kc.verify(ctx, plan)
        assert ring_rows(ctx) == []  # clean across every chunk edge
        source_slot_bytes(sources[1], slot + 1)[-1] ^= 0x80  # last byte, second source
        kc.verify(ctx, plan)
        assert [(row[1], row[7]) for row in ring_rows(ctx)] == [
            (slot + 1, int(F.VERIFY_REAL_KV_HASH_MISMATCH))], slot


def test_real_kv_past_the_real_chunk_size_verifies_clean_then_catches_the_edge(numpy_fold):
    n = realkv.CHUNK_SLOTS + 2
    sources = _sources(n + 1)
    ctx = make_context(num_slots=n + 1, sources=sources, mode=ALL)
    plan = _chain(ctx, n)
    kc.verify(ctx, plan)
    assert ring_rows(ctx) == []
    edge_slot = realkv.CHUNK_SLOTS + 1  # entry 8,192
    source_slot_bytes(sources[0], edge_slot)[0] ^= 1
    kc.verify(ctx, plan)
    assert [row[1] for row in ring_rows(ctx)] == [edge_slot]
