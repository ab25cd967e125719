"""The compiled SplitMix64 and chain link (numba) give numpy's values, word for word: on
contiguous and strided (record column) inputs, empty and long arrays; they step aside to
numpy's rounds where an argument is not a one-dimensional uint64 array of the same length,
or is read-only; and a launch gives the same records and rows either way."""

import numpy as np
import pytest

import kvcanary as kc
from builders import make_context, make_sources, make_verify_plan, ring_rows, write_tokens
from kvcanary.backends.reference import chain_compiled
from kvcanary.format import hashing


@pytest.fixture(autouse=True)
def _needs_numba():
    pytest.importorskip("numba", reason="the compiled rounds need numba: pip install 'kvcanary[fast]'")
    assert chain_compiled.kernels() is not None


def _words(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << 63, size=n, dtype=np.uint64) * np.uint64(3)


@pytest.mark.parametrize("n", [0, 1, 17, 4096 + 5])
def test_splitmix_is_numpys(n):
    x = _words(n)
    expected = hashing.splitmix64_inplace(x.copy())
    assert chain_compiled.splitmix64_inplace(x) is x
    assert x.tolist() == expected.tolist()


@pytest.mark.parametrize("n", [0, 1, 17, 4096 + 5])
def test_the_link_is_numpys_on_record_columns(n):
    records = _words(4 * n, seed=1).view(np.int64).reshape(n, 4)
    token, position = records[:, 0].view(np.uint64), records[:, 1].view(np.uint64)
    acc = records[:, 2].copy().view(np.uint64)
    expected = hashing.link_inplace(acc.copy(), token, position)
    assert chain_compiled.link_inplace(acc, token, position).tolist() == expected.tolist()
    acc2 = records[:, 3].copy().view(np.uint64)
    expected = hashing.mix3_inplace(acc2.copy(), token, position)
    assert chain_compiled.mix3_inplace(acc2, token, position).tolist() == expected.tolist()


def test_what_the_loops_do_not_take_runs_numpys_rounds(monkeypatch):
    calls = []
    monkeypatch.setattr(hashing, "mix3_inplace", lambda *a: calls.append("mix3") or a[0])
    monkeypatch.setattr(hashing, "splitmix64_inplace", lambda x: calls.append("splitmix") or x)
    read_only = _words(4)
    read_only.flags.writeable = False
    chain_compiled.splitmix64_inplace(read_only)
    chain_compiled.splitmix64_inplace(_words(4).view(np.int64))     # not uint64
    chain_compiled.mix3_inplace(_words(4), _words(3), _words(4))    # lengths differ
    chain_compiled.mix3_inplace(_words(4), np.uint64(5), _words(4))  # a scalar, broadcast
    assert calls == ["splitmix", "splitmix", "mix3", "mix3"]
    monkeypatch.setattr(chain_compiled, "ENABLED", False)
    assert chain_compiled.kernels() is None


def _launches():
    """Records and rows of a few writes and a verify over a source, one tampered slot."""
    ctx = make_context(sources=make_sources(1, 32, fill="random"), mode=kc.RealKvHashMode.ALL)
    write_tokens(ctx, [1, 2, 3, 4], [11, 12, 13, 14], [0, 1, 2, 3])
    write_tokens(ctx, [5, 6], [15, 16], [4, 5], seed=4)
    ctx.canary_buf[3, 0] ^= 1
    kc.verify(ctx, make_verify_plan([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5],
                                    [-1, 1, 2, 3, 4, 5]))
    return ctx.canary_buf.tobytes(), ring_rows(ctx)


def test_a_launch_gives_the_same_records_and_rows_either_way(monkeypatch):
    compiled = _launches()
    monkeypatch.setattr(chain_compiled, "ENABLED", False)
    assert compiled == _launches()
    assert compiled[1]      # the tampered slot was found
