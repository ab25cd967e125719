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
