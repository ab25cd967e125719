"""Findings that name their cause: the shared diagnosis in the audit (hand-built dumps and
synth faults), in an engine's own launches (attribution and merging), and the plan's
capacity report."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from click.testing import CliRunner
from test_audit import build, fields, run

import kvcanary as kc
from kvcanary.cli.main import main
from kvcanary.dump import load
from kvcanary.synth import SynthConfig, Synthesis

# build(): rows 1, 2, 3 at batch indices 0, 2, 3; row 1 maps slots 5..10 (positions 0..5),
# row 3 slots 30..33.


def test_a_slot_another_live_request_maps_names_both_requests(tmp_path):
    arrays = build()
    arrays["req_to_token"][3, 1] = 9   # row 3 position 1 -> slot 9, row 1's position 4
    result = run(tmp_path, arrays)
    first = next(f for f in result.findings if f.position == 1 and f.request_row == 3)
    assert first.diagnosis.cause == "shared-slot"
    assert first.diagnosis.related == ({"request_row": 1, "batch_index": 0, "position": 4,
                                        "slot": 9},)
    assert "also mapped by request row 1 (batch index 0, position 4)" in first.cause
    assert "request row 3 (batch index 3, position 1)" in first.cause


def test_synth_alias_names_the_request_whose_record_is_read(tmp_path):
    synthesis = Synthesis(SynthConfig(requests=24, seed=3))
    synthesis.run()
    (fault,) = synthesis.inject("alias", 1)
    d = load(kc_save(tmp_path, synthesis))
    result = kc_audit(d)
    at = [f for f in result.findings
          if (f.request_row, f.position) == (fault.request_row, fault.position)]
    other_row, other_position = map(int, re.search(
        r"request row (\d+), position (\d+)", fault.note).groups())
    assert at[0].diagnosis.cause == "shared-slot"
    assert (other_row, other_position) in {(r["request_row"], r["position"])
                                           for r in at[0].diagnosis.related}


def kc_save(tmp_path, synthesis):
    from kvcanary.dump import save

    return save(str(tmp_path / "s.npz"), **synthesis.arrays())


def kc_audit(d, **options):
    from kvcanary.audit import audit

    return audit(d, backend="numpy", **options)


def test_a_swap_within_a_request_is_named_as_a_swap(tmp_path):
    arrays = build()
    table = arrays["req_to_token"]
    table[3, 0], table[3, 3] = 33, 30
    result = run(tmp_path, arrays)
    head = next(f for f in result.findings if (f.request_row, f.position) == (3, 0))
    assert head.diagnosis.cause == "shifted-mapping"
    assert "swapped with position 3" in head.cause


def test_an_all_zero_record_is_never_written_not_a_reuse(tmp_path):
    arrays = build()
    fields(arrays)[33] = 0     # row 3, position 3: never written
    result = run(tmp_path, arrays)
    (finding,) = [f for f in result.findings if f.violation.slot_idx == 33]
    assert finding.diagnosis.cause == "never-written"
    assert "all-zero record" in finding.cause and "reused" not in finding.cause


def test_a_wholly_zero_canary_says_wrong_buffer(tmp_path):
    arrays = build()
    arrays["canary"][:] = 0
    result = run(tmp_path, arrays)
    assert result.findings and {f.diagnosis.cause for f in result.findings} == {"wrong-buffer"}
    assert result.zero_records == 15
    assert "15 of the 15 live entries" in result.findings[0].cause


def test_chain_only_breaks_tell_the_predecessor_from_the_own_link(tmp_path):
    arrays = build()
    fields(arrays)[31, 2] ^= 1          # row 3 position 1: its own chain link
    result = run(tmp_path, arrays)
    by_position = {f.position: f for f in result.findings if f.request_row == 3}
    assert by_position[1].diagnosis.cause == "link-changed"
    assert by_position[2].diagnosis.cause == "predecessor-changed"
    assert "predecessor slot 31 (position 1)" in by_position[2].cause


def test_only_the_token_breaking_is_a_wrong_token(tmp_path):
    arrays = build()
    fields(arrays)[32, 0] = 99
    result = run(tmp_path, arrays)
    finding = next(f for f in result.findings if f.violation.slot_idx == 32)
    assert finding.diagnosis.cause == "wrong-token" and "EAGLE" in finding.cause


def test_sweep_findings_get_a_cause_and_synth_prints_no_row_minus_one(tmp_path):
    out = tmp_path / "c.npz"
    printed = CliRunner().invoke(main, ["synth", str(out), "--requests", "24", "--seed", "3",
                                        "--inject", "token@cached"])
    assert printed.exit_code == 0, printed.output
    assert "row -1" not in printed.output and "sweep entry" in printed.output
    result = kc_audit(load(str(out)))
    sweep = [f for f in result.findings if f.kind == "sweep"]
    assert sweep and all(f.cause and f.diagnosis.cause != "unknown" for f in sweep)


def test_the_summary_says_reason_counts_are_per_check(tmp_path):
    from kvcanary.dump import save

    arrays = build()
    fields(arrays)[32, 1] = 9
    path = save(str(tmp_path / "d.npz"), **arrays)
    out = CliRunner().invoke(main, ["audit", path, "--backend", "numpy"]).output
    assert "counted per check (a row can fail several)" in out


# ------------------------------------------------------------------ in the engine


def engine_step(context, table, rows, prefix, extend, tokens, positions, out_loc, verify=True):
    vp, wp = kc.VerifyPlan.allocate(64), kc.WritePlan.allocate(len(rows))
    kc.plan(req_pool_indices=rows, prefix_lens=prefix, extend_seq_lens=extend,
            req_to_token=table, verify_plan=vp, write_plan=wp)
    if verify:
        kc.verify(context, vp)
    kc.write(context, wp, input_ids=tokens, positions=positions, out_cache_loc=out_loc)
    return vp


def toy_engine():
    """Two requests (rows 1, 2) of 4 tokens each, slots 1..4 and 11..14, prefilled."""
    from builders import i64, make_context

    context = make_context(num_slots=32, ring_capacity=64, kernel_kind=kc.LaunchTag.TAIL_K_FULL)
    table = np.zeros((3, 8), np.int64)
    table[1, :4], table[2, :4] = [1, 2, 3, 4], [11, 12, 13, 14]
    engine_step(context, table, i64([1, 2]), i64([0, 0]), i64([4, 4]),
                i64([7, 8, 9, 10, 17, 18, 19, 20]), i64([0, 1, 2, 3] * 2),
                i64([1, 2, 3, 4, 11, 12, 13, 14]), verify=False)
    return context, table


def test_engine_rows_map_back_to_request_and_position_and_merge_across_launches():
    from builders import i64

    context, table = toy_engine()
    table[2, 2] = 3          # row 2 position 2 reads row 1's slot 3 (position 2)
    merger = kc.Merger()
    for step in range(3):
        before = context.violation_log.total
        vp = kc.VerifyPlan.allocate(64)
        kc.plan(req_pool_indices=i64([1, 2]), prefix_lens=i64([4, 4]), extend_seq_lens=i64([0, 0]),
                req_to_token=table, verify_plan=vp, write_plan=kc.WritePlan.allocate(2))
        kc.verify(context, vp)
        found = kc.attribute(context, vp, req_pool_indices=i64([1, 2]), prefix_lens=i64([4, 4]),
                             since=before, launch=step)
        new = merger.add(found)
        assert len(new) == (len(found) if step == 0 else 0)   # each corruption reported once
    by_position = {f.entry.position: f for f in found}
    alias = by_position[2]
    assert (alias.entry.request_row, alias.entry.batch_index) == (2, 1)
    assert alias.diagnosis.cause == "shared-slot"
    line = alias.describe()
    assert line.splitlines()[0] == alias.violation.log_line()
    assert "\n  at: request row 2 (batch index 1), position 2, slot 3" in line
    assert line.endswith(f"\n  likely cause: {alias.diagnosis.text}")
    with pytest.warns(DeprecationWarning, match="describe"):
        assert alias.log_line() == line
    merged = merger.findings
    assert len(merged) == len(found) and all(m.count == 3 for m in merged)
    assert (merged[0].first_launch, merged[0].last_launch) == (0, 2)


def test_engine_attribution_names_the_other_request_on_a_shared_slot():
    from builders import i64

    context, table = toy_engine()
    table[2, 1] = 3          # row 2 position 1 -> slot 3: row 1's record of position 2
    vp = kc.VerifyPlan.allocate(64)
    kc.plan(req_pool_indices=i64([1, 2]), prefix_lens=i64([4, 4]), extend_seq_lens=i64([0, 0]),
            req_to_token=table, verify_plan=vp, write_plan=kc.WritePlan.allocate(2))
    kc.verify(context, vp)
    found = kc.attribute(context, vp, req_pool_indices=i64([1, 2]), prefix_lens=i64([4, 4]))
    alias = next(f for f in found if f.entry.position == 1)
    assert alias.diagnosis.cause == "shared-slot"
    assert alias.diagnosis.related[0]["request_row"] == 1
    assert alias.to_dict()["diagnosis"]["cause"] == "shared-slot"


def test_log_line_without_attribution_is_the_frozen_line():
    v = kc.Violation(2, 5, 1, 3, -1, 0, 0, 1)
    assert "\n" not in v.log_line() and v.log_line(at="x").endswith("\n  at: x")


def test_diagnosis_without_evidence_says_when_it_is_ambiguous():
    from kvcanary.findings.diagnosis import diagnose
    from kvcanary.findings.evidence import Entry

    v = kc.Violation(2, 5, 7, 3, -1, 11, 12, int(kc.FailReason.VERIFY_POSITION_MISMATCH
                                                  | kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH))
    d = diagnose(v, Entry(position=2, prev_slot=4))
    assert d.cause == "overwritten" and not d.certain
    assert d.alternatives == ("shifted-mapping", "shared-slot") and "fits too" in d.text


# ------------------------------------------------------------------ the plan's capacity


def plan_of(capacity, **options):
    from builders import i64, linear_req_to_token

    vp, wp = kc.VerifyPlan.allocate(capacity), kc.WritePlan.allocate(1)
    report = kc.plan(req_pool_indices=i64([1]), prefix_lens=i64([8]), extend_seq_lens=i64([1]),
                     req_to_token=linear_req_to_token(2, 16), verify_plan=vp, write_plan=wp,
                     **options)
    return vp, wp, report


def test_plan_reports_entries_needed_against_capacity():
    _, _, report = plan_of(8)
    assert (report.entries_needed, report.verify_capacity, report.enabled) == (8, 8, True)
    assert kc.entries_needed(np.array([1, 0]), np.array([8, 5]), swa_window_size=3) == 3


def test_a_too_small_verify_plan_warns_once_per_plan_and_strict_raises():
    from builders import i64, linear_req_to_token

    assert issubclass(kc.VerifyPlanTooSmall, UserWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vp, wp, report = plan_of(4)
        kc.plan(req_pool_indices=i64([1]), prefix_lens=i64([8]), extend_seq_lens=i64([1]),
                req_to_token=linear_req_to_token(2, 16), verify_plan=vp, write_plan=wp)
    too_small = [w for w in caught if issubclass(w.category, kc.VerifyPlanTooSmall)]
    assert len(too_small) == 1 and "8 prefix entries" in str(too_small[0].message)
    assert not report.enabled and int(vp.enable[0]) == 0
    with pytest.raises(ValueError, match="holds 4 entries but the batch has 8"):
        plan_of(4, strict=True)


def test_allocate_docstring_gives_the_sizing_rule():
    doc = kc.VerifyPlan.allocate.__doc__
    assert "sum(prefix_len - window_start)" in doc and "entries_needed" in doc


def test_on_a_paged_table_a_broken_link_names_the_predecessors_block_table_entry(tmp_path):
    synthesis = Synthesis(SynthConfig(requests=16, seed=5, block_size=16, page_size=16,
                                      num_slots=2048))
    synthesis.run()
    (fault,) = synthesis.inject("token", 1)
    result = kc_audit(load(kc_save(tmp_path, synthesis)))
    after = next(f for f in result.findings
                 if (f.request_row, f.position) == (fault.request_row, fault.position + 1))
    assert after.diagnosis.cause == "predecessor-changed"
    index = fault.position // 16
    assert f"block-table entry {index} (block " in after.cause


def test_engine_rows_on_a_slot_two_requests_share_go_to_both_requests():
    from builders import i64

    context, table = toy_engine()
    table[2, :2] = [1, 2]      # row 2 shares row 1's first two slots (a cached prefix)
    fields = context.canary_buf.view("<i8")[:, :4]
    # Row 2's own records at positions 2, 3 continue the shared prefix: rewrite them so.
    engine_step(context, table, i64([2]), i64([2]), i64([2]), i64([19, 20]), i64([2, 3]),
                i64([13, 14]), verify=False)
    fields[2, 2] ^= 1          # the shared record of position 1: its own link changed
    vp = kc.VerifyPlan.allocate(64)
    kc.plan(req_pool_indices=i64([1, 2]), prefix_lens=i64([4, 4]), extend_seq_lens=i64([0, 0]),
            req_to_token=table, verify_plan=vp, write_plan=kc.WritePlan.allocate(2))
    kc.verify(context, vp)
    found = kc.attribute(context, vp, req_pool_indices=i64([1, 2]), prefix_lens=i64([4, 4]))
    on_shared = [f for f in found if f.violation.slot_idx == 2]
    assert sorted(f.entry.request_row for f in on_shared) == [1, 2]
    assert {f.diagnosis.cause for f in on_shared} == {"link-changed"}


def test_a_write_row_at_a_known_position_says_which_input_is_off():
    from kvcanary.findings.diagnosis import diagnose
    from kvcanary.findings.evidence import Entry

    position_bit = int(kc.FailReason.WRITE_POSITION_MISMATCH)
    off = kc.Violation(2, 9, 39, 5, 5, 0, 38, position_bit)     # position id 39 at position 38
    assert diagnose(off, Entry(position=38)).text.endswith("written with position id 39")
    seed = kc.Violation(2, 9, 39, 5, 5, 0, 1, position_bit)     # right id, seed at position 0
    assert "chain seed) holds position 0" in diagnose(seed, Entry(position=39)).text
    token = kc.Violation(2, 9, 39, 7, 5, 0, 39, int(kc.FailReason.WRITE_TOKEN_MISMATCH))
    assert "input id 7 at position 39 is not the request's token 5" in \
        diagnose(token, Entry(position=39)).text
    assert diagnose(off).cause == "write-input" and "write-path check" in diagnose(off).text


def test_table_entries_past_a_request_length_are_not_its_own_chain(tmp_path):
    """A request's table row past its length holds leftovers (here: the slots of another
    request with the same prefix). An alias of its last entry onto that other request's slot
    is that request's slot (shared-slot), not a certain shift onto the request's own record
    read through a leftover entry."""
    import kvcanary as kc
    from kvcanary.audit import audit
    from kvcanary.dump import load, save

    canary = np.zeros((32, 32), np.uint8)
    context = kc.CanaryContext(
        canary, kernel_kind=kc.LaunchTag.TAIL_K_FULL, violation_log=kc.ViolationLog.allocate(8),
        slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64))
    tokens = np.array([11, 12, 13, 14, 15, 16, 17, 18], np.int64)
    table = np.zeros((3, 8), np.int32)
    table[1] = np.arange(10, 18)                      # request A: 8 tokens
    table[2, :4] = np.arange(20, 24)                  # request B: the same first 4 tokens
    for row, n in ((1, 8), (2, 4)):
        vp, wp = kc.VerifyPlan.allocate(16), kc.WritePlan.allocate(1)
        kc.plan(req_pool_indices=np.array([row]), prefix_lens=np.array([0]),
                extend_seq_lens=np.array([n]), req_to_token=table, verify_plan=vp, write_plan=wp)
        kc.write(context, wp, input_ids=tokens[:n], positions=np.arange(n, dtype=np.int64),
                 out_cache_loc=table[row, :n].astype(np.int64))
    table[2, 4:] = np.arange(14, 18)                  # leftovers past B's length: A's slots
    table[2, 3] = 16                                  # the fault: B's last entry -> A's position 6
    pool = np.zeros((3, 8), np.int32)
    pool[1], pool[2, :4] = tokens, tokens[:4]
    path = save(str(tmp_path / "d.npz"), canary=canary, req_to_token=table,
                req_pool_indices=np.array([1, 2], np.int64), seq_lens=np.array([8, 4], np.int64),
                expected_tokens=pool, expected_tokens_valid_lens=np.array([8, 4], np.int64))
    result = audit(load(path), backend="numpy", max_findings=0)
    (finding,) = [f for f in result.findings if (f.request_row, f.position) == (2, 3)]
    assert finding.violation.slot_idx == 16 and finding.violation.position == 6
    d = finding.diagnosis
    assert d.cause == "shared-slot" or not d.certain, (d.cause, d.text)
    assert d.cause == "shared-slot"
