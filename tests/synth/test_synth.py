"""The serving simulation: honest runs audit clean in every configuration, the allocator and
cache behave like a server's, and every injected fault is detected with the expected bits."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

from kvcanary.audit import audit
from kvcanary.synth import (
    EXPECTED_BITS,
    FAULT_KINDS,
    TARGET_CLASSES,
    SynthConfig,
    SynthError,
    Synthesis,
    faults_from_dump,
    parse_inject,
    score,
)
from synth_support import SMALL, roundtrip, run


COMBOS = [dict(page_size=p, swa_window=w, sources=s, mode=m)
          for p, w, s, m in itertools.product((1, 4), (0, 20), range(5), ("none", "partial", "all"))]


@pytest.mark.parametrize("options", COMBOS, ids=lambda o: "p{page_size}-w{swa_window}-s{sources}-{mode}".format(**o))
def test_clean_workload_audits_clean(tmp_path, options):
    synthesis = run(seed=7, **options)
    d = roundtrip(tmp_path, synthesis)
    result = audit(d, backend="numpy")
    assert result.total_violations == 0, [f.violation.log_line() for f in result.findings[:3]]
    assert result.live_entries > 0
    assert result.entries_checked == result.live_entries + result.sweep_entries
    if options["swa_window"]:
        assert d.swa_window_size == 20 and d.full_to_swa_index_mapping is not None
        assert d.launch_tag.name == "TAIL_K_SWA"
    assert len(d.real_kv) == options["sources"]


def test_simulation_behaves_like_a_server():
    s = run(num_slots=512, requests=40, seed=3)
    st = s.stats
    assert st.cached_tokens_reused > 0      # radix prefix sharing happened
    assert st.slots_reused > 0               # freed slots were handed out again
    assert st.blocks_evicted > 0             # the small pool forced evictions
    assert st.verify_launches > 0 and st.entries_verified > 0
    rows, seq_lens = s.live()
    assert rows.size > 0 and (rows != 0).all()
    for row, length in zip(rows, seq_lens):
        assert (s.table[row, :length] != 0).all()   # slot 0 never handed out
    # Live requests sharing a cached prefix map the same slots (this run keeps several).
    shared = [r for r in s.running if r.matched > 0]
    assert len(shared) >= 2
    for r in shared:
        cached = np.concatenate([b.slots for b in r.blocks])
        np.testing.assert_array_equal(s.table[r.row, :r.matched], cached)
    by_block = {}
    for r in shared:
        by_block.setdefault(id(r.blocks[0]), []).append(r)
    pairs = [group[:2] for group in by_block.values() if len(group) > 1]
    assert pairs  # two live requests on one cached block
    for first, second in pairs:
        np.testing.assert_array_equal(s.table[first.row, :first.matched],
                                      s.table[second.row, :second.matched])
    assert s.sweep_entries() is not None


def test_deterministic_with_seed():
    a, b, c = run(seed=11).arrays(), run(seed=11).arrays(), run(seed=12).arrays()
    for key in ("canary", "req_to_token", "seq_lens", "real_kv_0"):
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["canary"], c["canary"])


@pytest.mark.parametrize("options", [dict(), dict(page_size=4, swa_window=24, sources=3),
                                     dict(page_size=2, sources=2, mode="all")],
                         ids=["default", "paged-swa", "paged"])
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_every_fault_kind_detected_with_expected_bits(tmp_path, options, kind):
    synthesis = run(seed=5, **options)
    synthesis.inject(kind, 2)
    d = roundtrip(tmp_path, synthesis)
    faults = faults_from_dump(d)
    assert [f.kind for f in faults] == [kind, kind]
    result = audit(d, backend="numpy")
    assert result.unattributed == 0
    for outcome in score(faults, result):
        assert outcome.visible
        assert outcome.detected, outcome
        assert outcome.fired_bits & int(EXPECTED_BITS[kind]) == int(EXPECTED_BITS[kind])


@pytest.mark.parametrize("mode", ["partial", "all"])
def test_stale_reuse_in_a_copied_run_keeps_the_real_kv_hash_true(tmp_path, mode):
    # The campaign injects into a deep copy of a finished run. A stale reuse rewrites the
    # slot's KV and its record as another sequence's write would, so the record's real-KV
    # hash matches the KV there: only the position (and chain) checks may fire.
    synthesis = copy.deepcopy(run(seed=5, sources=4, mode=mode))
    synthesis.inject("stale-reuse", 2)
    result = audit(roundtrip(tmp_path, synthesis), backend="numpy")
    assert result.counts_by_reason.get("verify_position") == 2
    assert "verify_real_kv_hash" not in result.counts_by_reason, result.counts_by_reason


def test_real_kv_byte_visibility_follows_the_mode(tmp_path):
    for mode, visible in (("none", [False, False]), ("partial", [True, False]),
                          ("all", [True, True])):
        synthesis = run(seed=2, mode=mode, sources=2, bytes_per_token=32)
        synthesis.inject("real-kv-byte", 2)   # first in bytes [0, 16), second in [16, 32)
        d = roundtrip(tmp_path, synthesis, f"{mode}.npz")
        outcomes = score(faults_from_dump(d), audit(d, backend="numpy"))
        assert [o.visible for o in outcomes] == visible
        assert [o.detected for o in outcomes] == visible
        for o in outcomes:
            if not o.visible:
                assert f"not visible in {mode} mode" in o.note


def test_slot_zero_is_only_seen_by_the_extension(tmp_path):
    synthesis = run(seed=4)
    synthesis.inject("slot-zero")
    d = roundtrip(tmp_path, synthesis)
    strict = audit(d, backend="numpy")
    compat = audit(d, backend="numpy", compat=True)
    assert strict.counts_by_reason == {"slot_zero_in_prefix": 1}
    assert compat.total_violations == 0
    outcome = score(faults_from_dump(d), compat)[0]
    assert not outcome.visible and not outcome.detected and "--compat" in outcome.note


def test_faults_hit_distinct_entries():
    synthesis = run(seed=9, requests=40)
    for kind in FAULT_KINDS:
        synthesis.inject(kind)
    targets = [(f.request_row, f.position) for f in synthesis.faults]
    assert len(set(targets)) == len(targets)
    assert len({f.slot for f in synthesis.faults}) == len(targets)


def test_parse_inject_and_bad_options():
    assert parse_inject(["token", "alias:3@head"]) == [("token", 1, "interior"),
                                                        ("alias", 3, "head")]
    assert [k for k, _, _ in parse_inject(["all"])] == list(FAULT_KINDS)
    assert [t for _, _, t in parse_inject(["swap:2@all"])] == list(TARGET_CLASSES)
    with pytest.raises(SynthError, match="unknown target class 'middle'"):
        parse_inject(["token@middle"])
    assert parse_inject(["token+alias:2@chain-seam"]) == [("token+alias", 2, "chain-seam")]
    with pytest.raises(SynthError, match="a pair shape takes KIND\\+KIND"):
        parse_inject(["slot-zero+token@shared-block"])
    with pytest.raises(SynthError, match="unknown fault kind 'bogus'"):
        parse_inject(["bogus"])
    with pytest.raises(SynthError, match="COUNT must be an integer"):
        parse_inject(["token:x"])
    with pytest.raises(SynthError, match="--bytes-per-token"):
        SynthConfig(bytes_per_token=24).validate()
    with pytest.raises(SynthError, match="--mode"):
        SynthConfig(mode="most").validate()
    with pytest.raises(SynthError, match="--slots"):
        SynthConfig(num_slots=64).validate()
    with pytest.raises(SynthError, match="needs at least one real-KV source"):
        run(sources=0).inject("real-kv-byte")


def test_honest_run_raises_on_a_violation(monkeypatch):
    """The simulation's own verify is live: corrupting a record mid-run is caught."""
    synthesis = Synthesis(SynthConfig(**SMALL, verify_every=1))
    original = synthesis._step
    calls = {"n": 0}

    def corrupting_step():
        calls["n"] += 1
        if calls["n"] == 6:
            live = synthesis.running[0]
            slot = int(synthesis.table[live.row, max(0, live.seq_len - 1)])
            synthesis.canary.view("<i8")[slot, 1] += 1
        original()

    monkeypatch.setattr(synthesis, "_step", corrupting_step)
    with pytest.raises(SynthError, match="honest simulation produced canary violations"):
        synthesis.run()


@pytest.mark.slow
def test_scale_ten_thousand_requests_four_million_slots():
    import time

    started = time.perf_counter()
    synthesis = Synthesis(SynthConfig(requests=10_000, num_slots=4 << 20, max_running=64)).run()
    assert time.perf_counter() - started < 60
    assert synthesis.admitted == 10_000


from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


OUT_OF_TARGETS = ("ran out of distinct live entries to inject faults into; use more requests "
                  "or fewer faults", "alias needs a second live request with an owned entry")


@settings(max_examples=int(__import__("os").environ.get("KVC_SYNTH_EXAMPLES", "20")), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(page_size=st.sampled_from([1, 2, 8]), swa=st.sampled_from([0, 12, 40]),
       sources=st.integers(0, 3), mode=st.sampled_from(["none", "partial", "all"]),
       bytes_per_token=st.sampled_from([16, 48]), chunk=st.sampled_from([3, 17, 64]),
       seed=st.integers(0, 2**16),
       kinds=st.lists(st.sampled_from(FAULT_KINDS), min_size=1, max_size=4))
def test_random_workloads_audit_clean_and_catch_visible_faults(
        tmp_path, page_size, swa, sources, mode, bytes_per_token, chunk, seed, kinds):
    """KVC_SYNTH_EXAMPLES=400 runs a longer search."""
    synthesis = run(requests=30, page_size=page_size, swa_window=swa, sources=sources, mode=mode,
                    bytes_per_token=bytes_per_token, chunk_size=chunk, seed=seed)
    clean = audit(roundtrip(tmp_path, synthesis, "clean.npz"), backend="numpy")
    assert clean.total_violations == 0
    injected = 0
    for kind in kinds:
        if kind == "real-kv-byte" and not sources:
            with pytest.raises(SynthError, match="needs at least one real-KV source"):
                synthesis.inject(kind)
            continue
        try:
            synthesis.inject(kind)
            injected += 1
        except SynthError as exc:  # a small live set can run out of targets: it says so
            assert str(exc) in OUT_OF_TARGETS, exc
    assume(injected > 0)  # an example without a fault proves nothing: hypothesis draws another
    d = roundtrip(tmp_path, synthesis, "faulty.npz")
    result = audit(d, backend="numpy")
    assert result.unattributed == 0
    outcomes = score(faults_from_dump(d), result)
    assert len(outcomes) == injected  # a refused injection left no fault behind
    for outcome in outcomes:
        assert outcome.detected == outcome.visible, outcome


def test_inject_typos_get_the_nearest_name_and_paged_kinds_say_what_they_need():
    with pytest.raises(SynthError, match="unknown fault kind 'alais': did you mean 'alias'"):
        parse_inject(["alais:2"])
    with pytest.raises(SynthError, match="unknown target class 'sahred': did you mean 'shared'"):
        parse_inject(["alias:2@sahred"])
    # A known kind of the paged layout is not called unknown.
    with pytest.raises(SynthError, match="'evicted-block' is a paged-layout kind: it needs "
                                         "--block-size") as info:
        parse_inject(["evicted-block:2"])
    assert "unknown" not in str(info.value)
