"""Attribution at request boundaries: a fault on the first entry of a request (position 0,
or the head of a sliding window) is reported on that request's row, never on the row before
it, whatever the batch order, the empty requests between and the audit's chunking."""

import numpy as np
import pytest

from kvcanary.audit import audit
from kvcanary.format.consts import FailReason
from kvcanary.dump import load, save
from kvcanary.format.hashing import CHAIN_HEAD, link, to_signed

# batch index -> (request row, slots); row 0 is padding, row 4 has an empty prefix
BATCH = [(3, [40, 41, 42, 43]), (1, [10, 11, 12, 13, 14]), (0, []), (4, []),
         (2, [20, 21, 22]), (5, [50, 51, 52, 53, 54, 55])]


def clean_batch_arrays(tokens_offset=100):
    """A clean dump of BATCH: every record chained as write would stamp it."""
    canary = np.zeros((64, 32), np.uint8)
    records = canary.view("<i8")[:, :4]
    table = np.zeros((6, 8), np.int32)
    for row, slots in BATCH:
        table[row, :len(slots)] = slots
        prev = CHAIN_HEAD
        for position, slot in enumerate(slots):
            token = tokens_offset + slot
            records[slot, :3] = [token, position, to_signed(prev)]
            prev = link(prev, token, position)
    return dict(canary=canary, req_to_token=table,
                req_pool_indices=np.array([row for row, _ in BATCH], np.int64),
                seq_lens=np.array([len(slots) for _, slots in BATCH], np.int64))


def _owner(slot):
    for batch_index, (row, slots) in enumerate(BATCH):
        if slot in slots:
            return row, batch_index, slots.index(slot)
    raise AssertionError(f"slot {slot} belongs to no request")


def _where(result):
    return [(f.kind, f.request_row, f.batch_index, f.position, f.violation.slot_idx)
            for f in result.findings]


def _owned(slots):
    return [("request", *_owner(slot), slot) for slot in slots]


@pytest.mark.parametrize("chunk_entries", [1, 4, 5, 9, 1 << 20])
def test_fault_at_position_zero_is_on_its_own_request(tmp_path, chunk_entries):
    for _, slots in BATCH:
        if not slots:
            continue
        arrays = clean_batch_arrays()
        arrays["canary"].view("<i8")[slots[0], 1] = 7  # the head's stored position
        result = audit(load(save(str(tmp_path / "d.npz"), **arrays)), backend="numpy",
                       chunk_entries=chunk_entries)
        # the head itself (position) and its successor's chain link, both in this request
        assert sorted(_where(result), key=lambda w: w[-1]) == _owned(slots[:2]), slots
        assert result.findings[0].violation.fail_reason_bits == FailReason.VERIFY_POSITION_MISMATCH


@pytest.mark.parametrize("chunk_entries", [1, 3, 1 << 20])
def test_fault_at_a_window_head_is_on_its_own_request(tmp_path, chunk_entries):
    window = 2  # each request verifies its last two positions
    for _, slots in BATCH:
        if not slots:
            continue
        arrays = clean_batch_arrays()
        arrays.update(swa_window_size=np.int64(window),
                      full_to_swa_index_mapping=np.arange(64, dtype=np.int64))
        head = slots[max(0, len(slots) - window)]
        arrays["canary"].view("<i8")[head, 0] += 1  # the head's token: its successor's link breaks
        arrays["canary"].view("<i8")[head, 1] = 9  # and its own position
        result = audit(load(save(str(tmp_path / "d.npz"), **arrays)), backend="numpy",
                       chunk_entries=chunk_entries)
        assert sorted(_where(result), key=lambda w: w[-1]) == _owned(
            [head, slots[-1]] if len(slots) > 1 else [head]), slots
        assert result.live_entries == sum(min(window, len(s)) for row, s in BATCH if row)


def test_the_clean_batch_is_clean(tmp_path):
    result = audit(load(save(str(tmp_path / "d.npz"), **clean_batch_arrays())), backend="numpy")
    assert result.clean and result.live_entries == 4 + 5 + 3 + 6
