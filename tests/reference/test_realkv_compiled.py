"""The compiled real-KV fold (numba) gives the numpy fold's hashes, byte for byte: on the
transformers guard's layout (one cache tensor, each layer's K and V pages side by side) in
every dtype the guard handles, on strided and paged sources of mixed widths, both hash
modes, slot counts on both sides of the kernel's vector and block widths, word counts with
and without a tail past its eight-word chunks; and it steps aside (the numpy
fold runs) where it cannot read a source in place."""

import numpy as np
import pytest

import kvcanary as kc
import skip_reasons
from builders import make_context, make_sources, make_verify_plan, ring_rows, source_slot_bytes, write_tokens
from kvcanary.backends.reference import realkv, realkv_compiled
from kvcanary.format import hashing
from oracle import real_kv

ALL, PARTIAL = kc.RealKvHashMode.ALL, kc.RealKvHashMode.PARTIAL
# The kernel's slots per vector and per pass (realkv_kernel.LANES and BLOCK, a module that
# imports numba: the suite's collection does not); test_the_widths_are_the_kernels checks.
LANES, BLOCK = 8, 32


@pytest.fixture(autouse=True)
def _needs_numba():
    # here, not at import: collecting the suite does not load numba
    pytest.importorskip("numba", reason="the compiled fold needs numba: pip install 'kvcanary[fast]'")


def test_the_widths_are_the_kernels():
    from kvcanary.backends.reference import realkv_kernel

    assert (realkv_kernel.LANES, realkv_kernel.BLOCK) == (LANES, BLOCK)


def _both(monkeypatch, sources, mode, slots):
    """(compiled, numpy) real_kv_hash of ``slots``; the compiled path really ran."""
    assert all(realkv_compiled.fold_source(s, slots[:1], 16) is not None for s in sources)
    compiled = realkv.real_kv_hash(sources, mode, slots)
    with monkeypatch.context() as m:
        m.setattr(realkv_compiled, "ENABLED", False)
        assert realkv_compiled.fold_source(sources[0], slots[:1], 16) is None
        reference = realkv.real_kv_hash(sources, mode, slots)
    return compiled, reference


def _guard_layout(dtype, layers=3, heads=2, head_dim=8, page=4, blocks=5, seed=0):
    """Sources as the transformers guard builds them: one cache tensor viewed as
    ``[blocks, bytes per block]``, block = [L0 K page | L0 V page | L1 K page | ...]."""
    torch = pytest.importorskip("torch", reason=skip_reasons.transformers_extra("torch"))
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(blocks * 2 * layers * page * heads * head_dim, generator=generator)
    cache = cache.to(dtype)
    token_bytes = heads * head_dim * cache.element_size()
    page_bytes = page * token_bytes
    copy_view = cache.view(torch.uint8).view(blocks, -1)
    return [kc.RealKvSource(copy_view[:, i * page_bytes:(i + 1) * page_bytes], page_size=page,
                            num_bytes_per_token=token_bytes, read_bytes=token_bytes)
            for i in range(2 * layers)], blocks * page


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("count", [1, LANES - 1, LANES + 1, BLOCK, BLOCK + LANES + 3,
                                   2 * BLOCK + 1])
def test_guard_layout_hashes_as_the_numpy_fold(monkeypatch, dtype, count):
    torch = pytest.importorskip("torch", reason=skip_reasons.transformers_extra("torch"))
    sources, num_slots = _guard_layout(getattr(torch, dtype), blocks=12)
    rng = np.random.default_rng(count)
    slots = rng.choice(num_slots, size=count, replace=count > num_slots).astype(np.int64)
    for mode in (ALL, PARTIAL):
        compiled, reference = _both(monkeypatch, sources, mode, slots)
        assert compiled.tobytes() == reference.tobytes(), (dtype, count, mode)
        assert np.count_nonzero(compiled) == count


def test_k_only_and_every_source_agree_and_differ(monkeypatch):
    torch = pytest.importorskip("torch", reason=skip_reasons.transformers_extra("torch"))
    sources, num_slots = _guard_layout(torch.bfloat16, seed=3)
    slots = np.arange(num_slots, dtype=np.int64)[::-1].copy()
    k0, _ = _both(monkeypatch, sources[:1], ALL, slots)
    every, reference = _both(monkeypatch, sources, ALL, slots)
    assert every.tobytes() == reference.tobytes()
    assert not np.array_equal(k0, every)
    # the rule itself, slot by slot (tests/oracle.py's scalar fold)
    assert [hashing.to_signed(int(v)) for v in every[:5]] == [
        real_kv(sources, int(ALL), int(s)) for s in slots[:5]]


@pytest.mark.parametrize("page_size", [1, 3])
def test_strided_paged_sources_of_mixed_widths(monkeypatch, page_size):
    wide = make_sources(2, 40, bytes_per_token=48, page_size=page_size, row_gap=16,
                        fill="random", seed=1)
    narrow = make_sources(2, 40, bytes_per_token=32, read_bytes=16, page_size=page_size,
                          fill="random", seed=2, dtype=np.float32)
    sources = [wide[0], narrow[0], wide[1], narrow[1]]
    slots = np.random.default_rng(page_size).permutation(40).astype(np.int64)
    for mode in (ALL, PARTIAL):
        compiled, reference = _both(monkeypatch, sources, mode, slots)
        assert compiled.tobytes() == reference.tobytes()


@pytest.mark.parametrize("token_bytes", [16, 64, 80, 144, 528])
def test_every_word_count_and_slot_count(token_bytes):
    """Words per slot below, at and past the kernel's eight-word chunk with every tail (2, 8,
    10, 18, 66 words), slot counts from 1 to past two blocks, slots repeated and reversed."""
    sources = make_sources(1, 3 * BLOCK, bytes_per_token=token_bytes, page_size=4, row_gap=16,
                           fill="random", seed=token_bytes)
    rng = np.random.default_rng(token_bytes)
    for count in (1, 2, LANES, BLOCK - 1, BLOCK + 1, 2 * BLOCK + LANES + 5, 3 * BLOCK):
        slots = rng.integers(0, 3 * BLOCK, size=count).astype(np.int64)[::-1]
        compiled = realkv_compiled.fold_source(sources[0], slots, token_bytes)
        assert compiled is not None
        reference = realkv.fold_source(sources[0], slots, token_bytes)
        assert compiled.tobytes() == reference.tobytes(), (token_bytes, count)


def test_a_slot_past_a_source_hashes_to_zero_and_is_never_read(monkeypatch):
    short = make_sources(1, 8, bytes_per_token=32, fill="random", seed=4)
    long = make_sources(1, 40, bytes_per_token=32, fill="random", seed=5)
    slots = np.arange(20, dtype=np.int64)
    compiled = realkv.real_kv_hash(short + long, ALL, slots)
    with monkeypatch.context() as m:
        m.setattr(realkv_compiled, "ENABLED", False)
        reference = realkv.real_kv_hash(short + long, ALL, slots)
    assert compiled.tobytes() == reference.tobytes()
    assert not compiled[8:].any() and compiled[:8].all()
    assert realkv_compiled.fold_source(short[0], np.array([8]), 32) is None
    assert realkv_compiled.fold_source(short[0], np.array([-1]), 32) is None


def test_where_it_cannot_read_in_place_the_numpy_fold_runs():
    backing = np.zeros(8 * 32 + 4, dtype=np.uint8)     # numpy aligns its allocations
    unaligned = kc.RealKvSource(backing[4:].reshape(8, 32), page_size=1,
                                num_bytes_per_token=32, read_bytes=32)
    assert realkv_compiled.source_words(unaligned) is None
    compiled = realkv.real_kv_hash([unaligned], ALL, np.arange(8))
    assert compiled.tobytes() == realkv.fold_source(unaligned, np.arange(8), 32).tobytes()

    class Foreign:      # a source whose rows are no numpy array (CuPy's, on a device)
        tensor = [[0] * 32] * 8
    assert realkv_compiled.source_words(Foreign()) is None


def test_the_words_span_the_rows_read_only_and_keep_them_alive():
    import gc

    backing = np.arange(6 * 96, dtype=np.int64).view(np.uint8).reshape(6, 768)
    source = kc.RealKvSource(backing[:, 128:640], page_size=4, num_bytes_per_token=64,
                             read_bytes=64)
    words = realkv_compiled.source_words(source)
    start = 128 // 8
    assert words.shape == ((5 * 768 + 4 * 64) // 8,) and words.dtype == np.uint64
    assert not words.flags.writeable
    assert words.tolist() == backing.view(np.uint64).reshape(-1)[start:start + words.size].tolist()
    expected = words.tolist()
    del source, backing
    gc.collect()
    assert words.tolist() == expected       # the rows live while the words do


def test_verify_catches_one_flipped_bit_through_the_compiled_fold():
    torch = pytest.importorskip("torch", reason=skip_reasons.transformers_extra("torch"))
    sources, num_slots = _guard_layout(torch.float16, blocks=6, seed=7)
    n = num_slots - 1
    ctx = make_context(num_slots=num_slots, sources=sources, mode=ALL,
                       max_real_kv_sources=len(sources))
    slots = np.arange(1, n + 1)
    write_tokens(ctx, slots, (slots * 7 + 3) % 1000, slots - 1)
    plan = make_verify_plan(slots, slots - 1, np.concatenate([[-1], slots[:-1]]))
    kc.verify(ctx, plan)
    assert ring_rows(ctx) == []
    source_slot_bytes(sources[3], 17)[5] ^= 0x10      # layer 1's V, slot 17
    kc.verify(ctx, plan)
    assert [(row[1], row[7]) for row in ring_rows(ctx)] == [
        (17, int(kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH))]


def test_the_same_hashes_compiled_for_a_cpu_without_wide_vectors(tmp_path):
    """numba compiles for the host's CPU; the kernel's vector code must give the same hashes
    where LLVM lowers it to narrower instructions (numba's generic target: SSE2 on x86-64),
    not only with AVX-512's 64-bit multiply."""
    import os
    import subprocess
    import sys

    script = (
        "import numpy as np\n"
        "from numba.core import config\n"
        "import kvcanary as kc\n"
        "from kvcanary.backends.reference import realkv, realkv_compiled\n"
        "assert config.CPU_NAME == 'generic', config.CPU_NAME\n"
        "rng = np.random.default_rng(0)\n"
        "for token_bytes in (16, 80, 3072):\n"
        "    rows = rng.integers(0, 256, size=(40, 4 * token_bytes + 16), dtype=np.uint8)\n"
        "    source = kc.RealKvSource(rows, page_size=4, num_bytes_per_token=token_bytes,\n"
        "                             read_bytes=token_bytes)\n"
        "    slots = rng.integers(0, 160, size=77).astype(np.int64)\n"
        "    got = realkv_compiled.fold_source(source, slots, token_bytes)\n"
        "    want = realkv.fold_source(source, slots, token_bytes)\n"
        "    assert got is not None and got.tobytes() == want.tobytes(), token_bytes\n"
        "print('same')\n")
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES="",
               NUMBA_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-2000:]
