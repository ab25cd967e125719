"""Violation rows decode into kc.Violation and render upstream's text (docs/format.md §10, §11)."""

import json

import pytest

import kvcanary as kc
from builders import H0, make_context, make_verify_plan, signed, write_tokens

GOLDEN_BLOCK = """\
kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=verify_chain_hash+verify_position+verify_real_kv_hash slot_idx=17 position=42 stored_token=111 expected_token=0 stored_chain_hash=0x1111111111111111 expected_aux=0x2222222222222222
KV cache canary violation detected (kernel_kind=HEAD_K_FULL, slot_idx=17, position=42)
canary_kind:       per_forward_head_k_full
  fail_reasons: verify_chain_hash verify_position verify_real_kv_hash
  stored:   token_id=111   position=42 prev_hash=0x1111111111111111
  expected: prev_hash=0x2222222222222222
  total_violations=1 ring_overflow=False step_when_pumped=7"""


def golden_violation():
    return kc.Violation.from_row([0, 17, 42, 111, 0, 0x1111111111111111, 0x2222222222222222,
                                  1 | 2 | 4])


def test_golden_block():
    v = golden_violation()
    assert v.format_block(total_violations=1, ring_overflow=False,
                          step_when_pumped=7) == GOLDEN_BLOCK
    assert v.log_line() == GOLDEN_BLOCK.splitlines()[0]


def test_golden_row_decodes_from_the_ring():
    ctx = make_context(kernel_kind=kc.LaunchTag.HEAD_K_FULL)
    write_tokens(ctx, [5], [33], [0])
    kc.verify(ctx, make_verify_plan([5], [99], [-1]), check_expected_token=True)
    (v,) = ctx.violation_log.violations()
    assert v == kc.Violation(0, 5, 0, 33, -1, signed(H0), signed(H0), 2)
    assert v.fail_reason == kc.FailReason.VERIFY_POSITION_MISMATCH
    assert v.to_row().tobytes().hex() == (
        "0000000000000000" "0500000000000000" "0000000000000000" "2100000000000000"
        "ffffffffffffffff" "16b7a1a923ae7fde" "16b7a1a923ae7fde" "0200000000000000")
    assert v.log_line() == (
        "kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=verify_position slot_idx=5 "
        "position=0 stored_token=33 expected_token=-1 stored_chain_hash=0xde7fae23a9a1b716 "
        "expected_aux=0xde7fae23a9a1b716")


def test_to_dict_is_json_ready():
    d = golden_violation().to_dict()
    assert d == {
        "launch_tag": "HEAD_K_FULL",
        "fail_reason": "verify_chain_hash+verify_position+verify_real_kv_hash",
        "fail_reason_bits": 7,
        "slot_idx": 17,
        "position": 42,
        "stored_token": 111,
        "expected_token": 0,
        "stored_chain_hash": "0x1111111111111111",
        "expected_aux": "0x2222222222222222",
    }
    assert json.loads(json.dumps(d)) == d


@pytest.mark.parametrize("bit, label", [
    (1, "verify_chain_hash"), (2, "verify_position"), (4, "verify_real_kv_hash"),
    (8, "write_token"), (16, "write_position"), (32, "verify_token"),
    (64, "slot_out_of_range"), (128, "slot_zero_in_prefix")])
def test_labels(bit, label):
    v = kc.Violation(2, 1, 0, 0, 0, 0, 0, bit)
    assert f"fail_reason={label} " in v.log_line()


def test_no_bits_is_none():
    v = kc.Violation(2, 1, 0, 0, 0, 0, 0, 0)
    assert "fail_reason=none " in v.log_line()
    assert "  fail_reasons: none" in v.format_block(total_violations=0, ring_overflow=False,
                                                   step_when_pumped=0)


def test_write_block_shows_actual_and_expected_position_decimal():
    v = kc.Violation(int(kc.LaunchTag.TAIL_K_FULL), 3, 7, 5, 9, -1, 12, 8 | 16)
    block = v.format_block(total_violations=300, ring_overflow=True, step_when_pumped=0)
    lines = block.splitlines()
    assert lines[0].endswith("stored_chain_hash=0xffffffffffffffff expected_aux=0x000000000000000c")
    assert lines[2] == "canary_kind:       per_forward_tail_k_full"
    assert lines[3] == "  fail_reasons: write_token write_position"
    assert lines[4] == "  actual:   token_id=5   position=7 prev_hash=0xffffffffffffffff"
    assert lines[5] == "  expected: token_id=9   position=12"
    assert lines[6] == "  total_violations=300 ring_overflow=True step_when_pumped=0"


def test_verify_token_block_and_sweep_and_unknown_kinds():
    v = kc.Violation(int(kc.LaunchTag.SWEEP_V_SWA), 1, 2, 3, 4, 5, 6, 32)
    lines = v.format_block(total_violations=1, ring_overflow=False,
                           step_when_pumped=1).splitlines()
    assert lines[2] == "canary_kind:       sweep_v_swa"
    assert lines[5] == "  expected: token_id=4 prev_hash=0x0000000000000006"
    u = kc.Violation(99, 1, 2, 3, 4, 5, 6, 1)
    assert u.log_line().startswith("kv_canary violation: launch_tag=unknown(99) ")
    assert "canary_kind:       unknown(99)" in u.format_block(
        total_violations=1, ring_overflow=False, step_when_pumped=1)


def test_log_line_matches_upstream_regex():
    import re

    m = re.search(r"kv_canary violation: launch_tag=(\S+) fail_reason=(\S+)",
                  golden_violation().log_line())
    assert m.groups() == ("HEAD_K_FULL",
                          "verify_chain_hash+verify_position+verify_real_kv_hash")


def test_violation_log_state_after_overflow():
    ctx = make_context(ring_capacity=2)
    kc.verify(ctx, make_verify_plan([1, 2, 3], [0, 0, 0], [-1, -1, -1]))
    log = ctx.violation_log
    assert (log.total, log.valid_rows, log.ring_overflow, log.dropped, log.is_errored) == (
        3, 2, True, 1, True)
    assert [v.slot_idx for v in log.violations()] == [1, 2]
    log.clear()
    assert log.total == 0 and not log.ring.any()


def test_a_negative_write_index_is_corrupted_state_and_refused_on_read():
    # The index only counts up from 0 (and saturates): a negative one was written from
    # outside. Violations move it, yet it can stay negative; no read calls that clean.
    ctx = make_context(ring_capacity=4)
    log = ctx.violation_log
    log.write_index[0] = -5
    kc.verify(ctx, make_verify_plan([1, 2, 3], [0, 0, 0], [-1, -1, -1]))
    assert int(log.write_index[0]) == -2                  # the launch appends as the kernels do
    for read in ("is_errored", "total", "valid_rows", "ring_overflow", "dropped"):
        with pytest.raises(kc.CanaryError, match=r"^kv-canary: violation_write_index is -2: "
                           r"the log is corrupted") as caught:
            getattr(log, read)
        assert caught.value.key == "violation_write_index"
    with pytest.raises(kc.CanaryError, match="violation_write_index is -2"):
        log.violations()
    log.clear()
    assert log.total == 0 and not log.is_errored
