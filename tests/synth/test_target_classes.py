"""Fault target classes: every class and kind is scored at its sites (every request row that
maps a changed record, the prefix cache's sweep entry, the slot read), the cells the canary
cannot see by design stay unseen for the stated reason, and clean runs hold the classes."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from kvcanary import campaign
from kvcanary.campaign import layouts, runner
from kvcanary.audit import audit
from kvcanary.format.consts import FailReason
from kvcanary.dump import load, save
from kvcanary.synth.fault_kinds import PAIR_SHAPES
from kvcanary.synth import (
    FAULT_KINDS,
    TARGET_CLASSES,
    SynthConfig,
    Synthesis,
    faults_from_dump,
    score,
)

BUSY = dict(requests=64, num_slots=8192, max_running=16, prompt_len=(8, 48), output_len=(4, 16),
            shared_prefix_len=(16, 64), share_prob=0.9, chunk_size=16)
CONFIGS = {
    "flat": dict(seed=3, sources=2, mode="all"),
    "swa-paged": dict(seed=4, page_size=16, swa_window=40, sources=3, mode="partial",
                      bytes_per_token=32),
    "swa-none": dict(seed=8, swa_window=30, sources=1, mode="none", chunk_size=7),
}


def run(**options) -> Synthesis:
    return Synthesis(SynthConfig(**{**BUSY, **options})).run()


def roundtrip(tmp_path, synthesis, name="d.npz"):
    return load(save(str(tmp_path / name), **synthesis.arrays()))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def clean(request):
    return request.param, run(**CONFIGS[request.param])


def sites_reading(synthesis, slot):
    """(request row, position) of every live entry in its window whose canary slot is
    ``slot``, found from the state directly."""
    W = synthesis.config.swa_window
    found = []
    for r in synthesis.running:
        start = max(0, r.seq_len - W) if W else 0
        for p in range(start, r.seq_len):
            full = np.array([synthesis.table[r.row, p]], dtype=np.int64)
            if int(synthesis.allocator.canary_slots(full)[0]) == slot:
                found.append((r.row, p))
    return found


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_every_class_is_scored_at_its_sites(tmp_path, clean, kind):
    name, synthesis = clean
    if kind == "real-kv-byte" and not synthesis.sources:
        pytest.skip("no real-KV source")
    faulty = copy.deepcopy(synthesis)
    for target in TARGET_CLASSES:
        faulty.inject_up_to(kind, 3, target)
    d = roundtrip(tmp_path, faulty)
    faults = faults_from_dump(d)
    assert {f.target for f in faults} >= {"interior", "last", "chunk-boundary", "cached"}
    for rules in campaign.RULES:
        result = audit(d, backend="numpy", compat=rules == "compat")
        assert result.unattributed == 0
        for fault, outcome in zip(faults, score(faults, result)):
            scope = layouts.fault_scope(kind, synthesis.config.mode, fault.detail)
            should, why = campaign.designed(kind, synthesis.config.mode, scope, rules,
                                            fault.target)
            assert outcome.visible == should, (fault, why)
            assert outcome.detected == should, (fault, outcome)
            if not should:
                assert outcome.fired_bits == 0, (fault, outcome)
            if fault.target != "cached" and fault.kind not in ("alias", "swap", "slot-zero"):
                # A changed record is checked in every row that maps it, and nowhere else.
                rows = {(s.request_row, s.position) for s in fault.sites if s.entry == "request"}
                assert rows == set(sites_reading(faulty, fault.slot))


def test_a_shared_record_is_reported_by_every_row_that_maps_it(tmp_path):
    synthesis = run(seed=3)
    faults = synthesis.inject_up_to("position", 8, "head") + synthesis.inject_up_to(
        "position", 8, "shared")
    shared = [f for f in faults if len(sites_reading(synthesis, f.slot)) >= 2]
    assert shared, "the workload maps no record from two live rows"
    result = audit(roundtrip(tmp_path, synthesis), backend="numpy")
    for fault in shared:
        expected = set(sites_reading(synthesis, fault.slot))
        seen = {(f.request_row, f.position) for f in result.findings if f.kind == "request"
                and f.violation.slot_idx == fault.slot}
        assert seen == expected
        sweep = [f for f in result.findings if f.kind == "sweep"
                 and f.violation.slot_idx == fault.slot]
        assert [f.position for f in sweep] == [fault.position]
    assert all(o.detected and o.request_rows >= 1 for o in score(faults_from_dump(
        roundtrip(tmp_path, synthesis, "again.npz")), result))


def test_a_finding_on_the_wrong_row_at_position_0_is_a_miss(tmp_path):
    """The scorer checks attribution: the same bits under another request row do not count."""
    synthesis = run(seed=4)
    faults = synthesis.inject_up_to("token", 4, "head")
    assert faults
    d = roundtrip(tmp_path, synthesis)
    result = audit(d, backend="numpy")
    assert all(o.detected for o in score(faults_from_dump(d), result))
    rows = sorted({int(r.row) for r in synthesis.running})
    other = {row: rows[(rows.index(row) + 1) % len(rows)] for row in rows}
    result.findings = [dataclasses.replace(f, request_row=other[f.request_row])
                       if f.kind == "request" and f.position == 0 else f
                       for f in result.findings]
    assert not any(o.detected for o in score(faults_from_dump(d), result))


def test_a_chain_link_at_a_window_head_is_unseen_by_design(tmp_path):
    synthesis = run(**CONFIGS["swa-none"])
    faults = synthesis.inject_up_to("prev-hash", 6, "window-head")
    assert faults
    result = audit(roundtrip(tmp_path, synthesis), backend="numpy")
    at = {(f.request_row, f.position): f.violation.fail_reason_bits
          for f in result.findings if f.kind == "request"}
    lut = synthesis.lut
    for fault in faults:
        row, p = fault.request_row, fault.position
        # The predecessor's SWA slot is freed: verify cannot read it, the check is vacuous ...
        assert lut[synthesis.table[row, p - 1]] == 0
        assert (row, p) not in at
        # ... but the changed link still reaches the successor's chain check.
        seq_len = next(r.seq_len for r in synthesis.running if r.row == row)
        if p + 1 < seq_len:
            assert at[(row, p + 1)] == int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)


def test_cached_token_and_slot_zero_are_unseen_at_the_sweep_entry(tmp_path):
    synthesis = run(seed=3)
    tokens = synthesis.inject_up_to("token", 6, "cached")
    zeros = synthesis.inject_up_to("slot-zero", 6, "cached")
    assert tokens and zeros
    d = roundtrip(tmp_path, synthesis)
    result = audit(d, backend="numpy")
    sweep = {(f.position, f.violation.slot_idx): f.violation.fail_reason_bits
             for f in result.findings if f.kind == "sweep"}
    block = synthesis.config.block_tokens
    for fault in tokens:
        assert (fault.position, fault.slot) not in sweep
        if (fault.position + 1) % block:
            # Sweep entries carry no expected token; the successor's chain link breaks.
            successor = [bits for (p, _), bits in sweep.items() if p == fault.position + 1]
            assert int(FailReason.VERIFY_CHAIN_HASH_MISMATCH) in successor
    for fault in zeros:
        assert (fault.position, 0) not in sweep
    assert not any(o.visible for o in score(faults_from_dump(d), result))


@pytest.mark.parametrize("kind, target, options", [
    ("alias", "head", dict(max_running=6)),      # runs out of heads
    ("alias", "interior", dict(max_running=1)),  # a target, but no other row to alias
], ids=["out-of-targets", "out-of-partners"])
def test_inject_up_to_leaves_the_generator_as_inject_would(kind, target, options):
    config = dict(seed=5, requests=20, **options)
    first = run(**config)
    placed = len(first.inject_up_to(kind, 1000, target))
    assert placed < 1000
    first.inject("token", 2)
    second = run(**config)
    if placed:
        second.inject(kind, placed, target)
    second.inject("token", 2)
    a, b = first.arrays(), second.arrays()
    assert a.keys() == b.keys()
    for key in set(a) - {"synth_stats"}:     # (holds the run's wall time)
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def test_clean_runs_hold_shared_prefixes_window_edges_and_chunk_boundaries():
    for index in range(4):
        out = campaign.run_clean_task({"index": index, "seed": 0, "backends": ["numpy"]})
        assert out["missing"] == [] and not out["false_positives"]
        assert all(out["census"][t] > 0 for t in campaign.PER_TOKEN.clean_classes), out["census"]


def test_a_clean_run_without_a_class_fails_the_campaign(monkeypatch):
    real = runner.clean_run_config
    monkeypatch.setattr(runner, "clean_run_config",
                        lambda *args: {**real(*args), "swa_window": 0})
    monkeypatch.setattr(runner, "CLEAN_RUN_ATTEMPTS", 2)
    out = campaign.run_clean_task({"index": 0, "seed": 0, "backends": ["numpy"]})
    assert out["missing"] == ["window-head"] and out["replaced"] == 1
    report = campaign.CampaignReport(faults_per_kind=1, clean_runs=1, seed=0,
                                     backends=["numpy"], skipped_backends={}, jobs=1,
                                     clean_missing=[(0, out["missing"])])
    assert any("clean run 0 has no window-head entries" in f for f in report.failures())


def test_interacting_pairs_are_scored_at_their_own_sites(tmp_path):
    synthesis = run(seed=3)
    block = synthesis.config.block_tokens
    for a, b in layouts.PAIR_COMBOS:
        for shape in PAIR_SHAPES:
            synthesis.inject_up_to(f"{a}+{b}", 1, shape)
    faults = synthesis.faults
    pairs = list(zip(faults[::2], faults[1::2]))
    assert {first.target for first, _ in pairs} == set(PAIR_SHAPES)
    for first, second in pairs:
        assert first.request_row == second.request_row and first.target == second.target
        if first.target == "chain-seam":
            assert second.position == first.position + 1     # the seam: neighbours
        else:
            assert first.position // block == second.position // block
    d = roundtrip(tmp_path, synthesis)
    for compat in (False, True):
        outcomes = score(faults_from_dump(d), audit(d, backend="numpy", compat=compat))
        assert all(o.visible and o.detected for o in outcomes), \
            [o for o in outcomes if not o.detected]


def test_two_neighbouring_lost_writes_keep_a_consistent_chain(tmp_path):
    """Why lost-write + lost-write is not paired: link(0, 0, 0) is 0, so the second zeroed
    record's chain link matches its zeroed predecessor; only its position check fires."""
    from kvcanary.format.hashing import link_inplace

    zero = np.zeros(1, dtype=np.uint64)
    assert int(link_inplace(zero.copy(), zero.copy(), zero.copy())[0]) == 0
    synthesis = run(seed=3)
    first, second = synthesis.inject("lost-write+lost-write", 1, "chain-seam")
    result = audit(roundtrip(tmp_path, synthesis), backend="numpy")
    at = {(f.request_row, f.position): f.violation.fail_reason_bits
          for f in result.findings if f.kind == "request"}
    bits = at[(second.request_row, second.position)]
    assert bits & FailReason.VERIFY_POSITION_MISMATCH
    assert not bits & FailReason.VERIFY_CHAIN_HASH_MISMATCH
    assert ("lost-write", "lost-write") not in layouts.PAIR_COMBOS
