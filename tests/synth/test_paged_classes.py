"""Paged runs get the target classes: every paged fault kind is placed at every class it
reaches, a block fault claims its target's whole block (its sites are every verified entry of
that block), and each is seen where the canary is designed to see it and only there, on the
one scoring path both layouts share."""

from __future__ import annotations

import copy

import pytest

from kvcanary.audit import audit
from kvcanary.campaign.layouts import designed, fault_scope
from kvcanary.synth import PAGED_FAULT_KINDS, SynthConfig, Synthesis, faults_from_dump, score
from kvcanary.synth.fault_kinds import kind_targets

CONFIG = dict(requests=24, num_slots=2048, max_running=8, prompt_len=(16, 96),
              output_len=(4, 16), sources=2, bytes_per_token=32)


@pytest.fixture(scope="module", params=[(4, 0, "all"), (16, 40, "partial")],
                ids=["block4", "block16-swa-partial"])
def clean(request):
    block, window, mode = request.param
    return Synthesis(SynthConfig(**CONFIG, block_size=block, swa_window=window, mode=mode,
                                 seed=11)).run()


@pytest.mark.parametrize("kind", PAGED_FAULT_KINDS)
def test_every_class_of_a_paged_kind_is_scored_at_its_sites(clean, kind):
    if kind == "evicted-block" and clean.config.swa_window:
        pytest.skip("a 40-token window rarely reuses a 16-slot cached block: the run with "
                    "4-slot blocks covers evicted-block")
    faulty = copy.deepcopy(clean)
    for target in kind_targets(kind):
        faulty.inject_up_to(kind, 3, target)
    d = faulty.dump()
    faults = faults_from_dump(d)
    assert faults and {f.target for f in faults} <= set(kind_targets(kind))
    bs = faulty.config.block_size
    for fault in faults:
        assert fault.sites, fault
        own = [s for s in fault.sites if s.request_row == fault.request_row]
        if kind in ("alias", "slot-zero") and fault.target != "cached":
            # the target's block, and only it, reads what changed in the target's row
            assert {s.position // bs for s in own} == {fault.position // bs}, fault
            assert fault.position in {s.position for s in own}
    for rules in ("kvcanary", "compat"):
        result = audit(d, backend="numpy", compat=rules == "compat")
        assert result.unattributed == 0
        for fault, outcome in zip(faults, score(faults, result)):
            scope = fault_scope(kind, faulty.config.mode, fault.detail)
            should, why = designed(kind, faulty.config.mode, scope, rules, fault.target)
            assert outcome.visible == should, (fault, why)
            assert outcome.detected == should, (fault, outcome)
            if not should:
                assert outcome.fired_bits == 0, (fault, outcome)


def test_evicted_block_reaches_only_mapped_cached_blocks(clean):
    from kvcanary.synth import SynthError

    with pytest.raises(SynthError, match="evicted-block reaches only head, shared"):
        copy.deepcopy(clean).inject("evicted-block", 1, "interior")
