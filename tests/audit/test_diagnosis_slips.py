"""Diagnoses that a one-line slip would change while the rest of the suite passes."""

from __future__ import annotations

from test_audit import build, fields, run


def test_a_shared_slot_whose_record_fails_for_both_readers_names_no_owner(tmp_path):
    arrays = build()
    arrays["req_to_token"][3, 1] = 9       # row 3 position 1 -> slot 9, row 1's position 4
    fields(arrays)[9, 0] ^= 1              # and slot 9's token changes: it fails for row 1 too
    result = run(tmp_path, arrays)
    on_nine = [f for f in result.findings if f.violation.slot_idx == 9]
    assert {f.request_row for f in on_nine} == {1, 3}
    # The record is neither reader's intact record: naming one of them its owner (shared-slot)
    # would blame the other request's mapping for what is a changed record.
    assert all(f.diagnosis.cause != "shared-slot" for f in on_nine), \
        [(f.request_row, f.diagnosis.cause) for f in on_nine]


def test_a_token_zero_chain_head_read_at_a_wrong_position_is_not_never_written(tmp_path,
                                                                              monkeypatch):
    """A real chain head may hold token 0 at position 0; its link is the anchor's, not 0.
    Only a record whose token, position and chain link are all zero was never written."""
    import test_audit

    monkeypatch.setitem(test_audit.TOKENS, 3, [0, 32, 33, 34])
    arrays = build()
    assert fields(arrays)[30, :2].tolist() == [0, 0] and fields(arrays)[30, 2] != 0
    arrays["req_to_token"][3, 2] = 30      # row 3 position 2 -> slot 30, its own position 0
    result = run(tmp_path, arrays)
    (head,) = [f for f in result.findings if f.violation.slot_idx == 30]
    assert (head.request_row, head.position) == (3, 2)
    assert head.diagnosis.cause == "shifted-mapping", head.cause
    assert "all-zero" not in head.cause


def test_an_entry_pointing_at_its_own_shared_prefix_slot_is_a_shift_not_a_shared_slot(tmp_path):
    """Row 2's position 3 points at slot 6, its own position 1, which row 1 maps too (a
    common prefix): the record is row 2's own, so the mapping is shifted; calling it
    row 1's (shared-slot) would blame a double allocation."""
    arrays = build()
    arrays["req_to_token"][2, 3] = 6
    result = run(tmp_path, arrays)
    (shifted,) = [f for f in result.findings if f.violation.slot_idx == 6]
    assert (shifted.request_row, shifted.position) == (2, 3)
    assert shifted.diagnosis.cause == "shifted-mapping", shifted.cause
    assert "shifted by -2" in shifted.cause
