"""Hash pins and golden values: docs/format.md §3 and upstream's pinned vectors, through the public API."""

import numpy as np
import pytest

import kvcanary as kc
from builders import (H0, fields, make_context, make_verify_plan, ring_rows, signed,
                      source_slot_bytes, stamp, write_tokens)

M = (1 << 64) - 1

SPLITMIX_PINS = [
    (0x9E3779B97F4A7C15, 0xE220A8397B1DCDAF),
    (0x0000000000000001, 0x5692161D100B05E5),
    (0xDEADBEEFCAFEBABE, 0x7AD6664F09FFE52C),
    (0xFFFFFFFFFFFFFFFF, 0xB4D055FCF2CBBD7B),
    (0x8000000000000000, 0x25C26EA579CEA98A),
    (0xC0FFEE1234567890, 0xDE7FAE23A9A1B716),
]


@pytest.mark.parametrize("value, expected", SPLITMIX_PINS)
def test_splitmix64_pins_on_ints(value, expected):
    assert kc.splitmix64(value) == expected


def test_splitmix64_pins_on_arrays():
    inputs = np.array([v for v, _ in SPLITMIX_PINS], dtype=np.uint64)
    out = kc.splitmix64(inputs)
    assert out.dtype == np.uint64
    assert [int(v) for v in out] == [e for _, e in SPLITMIX_PINS]
    # signed input: the same bits give the same result
    out_signed = kc.splitmix64(inputs.view(np.int64))
    assert [int(v) for v in out_signed] == [e for _, e in SPLITMIX_PINS]
    # the input is not modified
    assert [int(v) for v in inputs] == [v for v, _ in SPLITMIX_PINS]


def test_splitmix64_of_zero_is_zero_and_anchor_is_h0():
    assert kc.splitmix64(0) == 0
    assert kc.CANARY_CHAIN_ANCHOR == 0xC0FFEE1234567890
    assert kc.splitmix64(kc.CANARY_CHAIN_ANCHOR) == H0
    assert kc.CHAIN_HEAD == H0
    assert signed(H0) == -2414019407054260458


def _three_step(a, b, c):
    h = kc.splitmix64(a & M)
    h = kc.splitmix64(h ^ (b & M))
    return kc.splitmix64(h ^ (c & M))


@pytest.mark.parametrize("prev, token, pos", [
    (0xC0FFEE1234567890, 0, 0),
    (0x1234567890ABCDEF, 100, 5),
    (0, 0xFFFF, 0x7FFFFFFF),
    (0x123, 1, 1),
    (0xFFFFFFFFFFFFFFFF, 0xFFFF, 0xFFFF),
])
def test_mix3_equals_explicit_three_step_fold(prev, token, pos):
    assert kc.splitmix64_mix3(prev, token, pos) == _three_step(prev, token, pos)
    arr = kc.splitmix64_mix3(np.array([prev], dtype=np.uint64), np.array([token]),
                             np.array([pos]))
    assert int(arr[0]) == _three_step(prev, token, pos)


def test_mix3_minus_one_differs_from_uint32_all_ones():
    assert kc.splitmix64_mix3(H0, -1, 0) == 0xE5A9A05404A720CF
    assert kc.splitmix64_mix3(H0, 0xFFFFFFFF, 0) == 0x43D564C35B87F27B
    # the same through arrays: int64 -1 vs a widened uint32 0xFFFFFFFF
    tokens = np.array([-1, 0xFFFFFFFF], dtype=np.int64)
    out = kc.splitmix64_mix3(np.full(2, H0, dtype=np.uint64), tokens, np.zeros(2, np.int64))
    assert [int(v) for v in out] == [0xE5A9A05404A720CF, 0x43D564C35B87F27B]
    out32 = kc.splitmix64_mix3(np.uint64(H0), np.array([0xFFFFFFFF], dtype=np.uint32), 0)
    assert int(np.asarray(out32).reshape(-1)[0]) == 0x43D564C35B87F27B


def test_mix3_order_matters():
    assert kc.splitmix64_mix3(1, 2, 3) != kc.splitmix64_mix3(1, 3, 2)
    assert kc.splitmix64_mix3(5, 5, 0) != 0


def test_signed_views():
    assert signed(H0) == -2414019407054260458
    assert signed(0x6041580849E6407D) == 6935921693750083709


def _legacy_xor_chain(tokens, positions) -> list:
    """Upstream's older chain, ``prev_{i+1} = splitmix64(prev_i ^ tok_i ^ pos_i)``."""
    chain = [H0]
    for tok, pos in zip(tokens[:-1], positions[:-1]):
        chain.append(kc.splitmix64(chain[-1] ^ tok ^ pos))
    return chain


def test_legacy_xor_chain_100_steps_is_not_the_newest_chain():
    """Upstream pinned the older XOR chain over 100 steps (tokens
    ``(i * 0x9E3779B97F4A7C15) & 0x7FFFFFFF``, positions ``i``) by its first, second and
    last prev hashes. kc.write over the same steps must store the newest (mix3) chain,
    which shares only the head."""
    positions = list(range(100))
    tokens = [(i * 0x9E3779B97F4A7C15) & 0x7FFFFFFF for i in positions]
    legacy = _legacy_xor_chain(tokens, positions)
    assert (legacy[0], legacy[1], legacy[-1]) == (
        0xDE7FAE23A9A1B716, 0xF0F807B576DF665D, 0x228B3F78A6FF1E32)
    ctx = make_context(num_slots=101)
    write_tokens(ctx, list(range(1, 101)), tokens, positions)
    stored = [int(v) & M for v in fields(ctx.canary_buf)[1:101, 2]]
    assert stored[0] == legacy[0] == H0
    assert all(new != old for new, old in zip(stored[1:], legacy[1:]))
    assert stored[1] == kc.splitmix64_mix3(H0, tokens[0], 0)


# ------------------------------------------------------------ chains through kc.write

CHAINS = [
    ([101, 202, 303, 404, 505],
     [0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1,
      0xC749AFFE5A5A9634], 0x3A650FCC4023CD13),
    ([11, 22, 33, 44, 55],
     [0xDE7FAE23A9A1B716, 0x89CD2ABFBEBC0649, 0x5782FFC5B5D6409B, 0xF53E51CD772BB95C,
      0x5FAE4135D917CB64], 0xAE76343810F54045),
]


@pytest.mark.parametrize("tokens, prev_hashes, last_link", CHAINS)
def test_golden_chain_through_write(tokens, prev_hashes, last_link):
    ctx = make_context(num_slots=8)
    write_tokens(ctx, [1, 2, 3, 4, 5], tokens, [0, 1, 2, 3, 4])
    recs = fields(ctx.canary_buf)
    assert [int(v) & M for v in recs[1:6, 2]] == prev_hashes
    assert [int(v) for v in recs[1:6, 0]] == tokens
    assert [int(v) for v in recs[1:6, 1]] == [0, 1, 2, 3, 4]
    assert [int(v) for v in recs[1:6, 3]] == [0] * 5
    last = recs[5]
    assert kc.splitmix64_mix3(int(last[2]), int(last[0]), int(last[1])) == last_link
    # verify of the same chain is clean
    plan = make_verify_plan([1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [-1, 1, 2, 3, 4])
    kc.verify(ctx, plan)
    assert ring_rows(ctx) == []


def test_golden_seeded_chain_through_write():
    ctx = make_context(num_slots=64)
    stamp(ctx.canary_buf, 42, 7, 10, H0)
    assert kc.splitmix64_mix3(H0, 7, 10) == 0x5E35681BCFCE7CF6
    write_tokens(ctx, [0, 1, 2, 3, 4], [101, 202, 303, 404, 505], [11, 12, 13, 14, 15], seed=42)
    assert [int(v) & M for v in fields(ctx.canary_buf)[0:5, 2]] == [
        0x5E35681BCFCE7CF6, 0x56D3E7D2989B8E36, 0xDD87E0146C9036A8, 0x1CBB47092FF8336E,
        0x3579999BB482D1FC]
    assert int(ctx.violation_log.write_index[0]) == 0


# ------------------------------------------------------------ real-KV golden values

def _hash_of_slot(sources, mode, slot=1, num_slots=4):
    ctx = make_context(num_slots=num_slots, sources=sources, mode=mode)
    write_tokens(ctx, [slot], [1], [0])
    return int(fields(ctx.canary_buf)[slot, 3]) & M


def _one_source(data: bytes, page_size=1, num_slots=4, slot=1):
    rows = -(-num_slots // page_size)
    tensor = np.zeros((rows, page_size * len(data)), dtype=np.uint8)
    src = kc.RealKvSource(tensor, page_size=page_size, num_bytes_per_token=len(data),
                          read_bytes=len(data))
    source_slot_bytes(src, slot)[:] = np.frombuffer(data, dtype=np.uint8)
    return src


def test_real_kv_pin_pattern_partial_and_all():
    pattern = bytes([0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80,
                     0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF])
    lo = int.from_bytes(pattern[:8], "little")
    hi = int.from_bytes(pattern[8:], "little")
    assert kc.splitmix64(kc.splitmix64(lo) ^ hi) == 0xF036E30B6961C78D
    for mode in (kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.ALL):
        assert _hash_of_slot([_one_source(pattern)], mode) == 0x6041580849E6407D


def test_real_kv_golden_32_bytes_all_and_partial():
    data = bytes(range(32))
    assert _hash_of_slot([_one_source(data)], kc.RealKvHashMode.ALL) == 0xB44181DFE9420039
    assert _hash_of_slot([_one_source(data)], kc.RealKvHashMode.PARTIAL) == 0xD6D75024DFD6C30C


def test_real_kv_two_sources_order_and_zero():
    a = bytes(range(0x01, 0x11))
    b = bytes(range(0x65, 0x75))
    mode = kc.RealKvHashMode.ALL
    assert _hash_of_slot([_one_source(a), _one_source(b)], mode) == 0x9FE760FF5D1F1F9E
    assert _hash_of_slot([_one_source(b), _one_source(a)], mode) == 0x39162C0B8E0C3CC2
    assert _hash_of_slot([_one_source(bytes(16))], mode) == 0


@pytest.mark.parametrize("count, expected", [
    (1, 0xD0D75FB652F288D8), (2, 0x33109C273CC3CC03), (4, 0x69C8723F948C531E)])
def test_real_kv_fixture_sources(count, expected):
    from builders import make_sources

    sources = make_sources(count, 8)
    ctx = make_context(num_slots=8, sources=sources, mode=kc.RealKvHashMode.ALL)
    write_tokens(ctx, [1, 2, 7], [5, 6, 7], [0, 1, 2])
    assert [int(v) & M for v in fields(ctx.canary_buf)[[1, 2, 7], 3]] == [expected] * 3


def test_real_kv_pin_verifies_clean_and_survives_page_size_16():
    pattern_a = bytes(range(0x01, 0x11))
    pattern_b = bytes(range(0x65, 0x75))
    tensor = np.zeros((2, 16 * 16), dtype=np.uint8)
    src = kc.RealKvSource(tensor, page_size=16, num_bytes_per_token=16, read_bytes=16)
    source_slot_bytes(src, 3)[:] = np.frombuffer(pattern_a, np.uint8)
    source_slot_bytes(src, 7)[:] = np.frombuffer(pattern_b, np.uint8)
    ctx = make_context(num_slots=32, sources=[src], mode=kc.RealKvHashMode.ALL)
    write_tokens(ctx, [3, 7], [1, 2], [0, 1])
    h3, h7 = (int(v) & M for v in fields(ctx.canary_buf)[[3, 7], 3])
    assert h3 == _hash_of_slot([_one_source(pattern_a)], kc.RealKvHashMode.ALL)
    assert h7 == _hash_of_slot([_one_source(pattern_b)], kc.RealKvHashMode.ALL)
    assert h3 != h7
