"""Pins: synth and campaign outputs are a function of the seed and options only, bit for bit.
A refactor of the simulation must leave every digest here unchanged; a deliberate change of
the simulation (or of its random draws) updates them, and says so in its commit."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from kvcanary.campaign import render
from kvcanary.synth import FAULT_KINDS, PAGED_FAULT_KINDS, SynthConfig, Synthesis, SynthError

SMALL = dict(requests=24, num_slots=1024, max_running=8, prompt_len=(8, 48), output_len=(4, 16),
             shared_prefix_len=(16, 40))

SYNTH_PINS = [
    (dict(seed=0), "c528542a9f81446db36d6b470e70a79a528f3f7423a1c1e5eb2e262eef34875c"),
    (dict(seed=5, page_size=4, swa_window=24, sources=3, mode="partial"),
     "129ff2c63c492fdfa08ccebba3969e9f7e68fd98ac18a4117c70131d2fbd37dc"),
    (dict(seed=1, page_size=16, num_slots=2048, sources=2, chunk_size=17),
     "46b59aa71ed131786be7dc298c02f640e5faddbfbacba20680db2bb36001f440"),
    (dict(seed=2, swa_window=40, sources=4, mode="none", bytes_per_token=48),
     "e90901627d5620e9d6c3eeb05d4bf2bf0c956228873764da0d6aa75e5ec0ecf3"),
]
CAMPAIGN_PIN = "e8517952b2a109bda639ad148a5f8c907c836dc2c1997d230219ae25c48beba3"
# Paged engines (block tables): every paged fault kind at its default class, twice where the
# run has room (a kind that runs out is refused, and the refusals are pinned too).
PAGED_SYNTH_PINS = [
    (dict(seed=0, block_size=4),
     "2adc5186f4bc3ac461889e4b4a0616c8b3f2cda173a081a7de864231a62b2ea9", []),
    (dict(seed=5, block_size=8, swa_window=24, sources=3, mode="partial"),
     "8e78d7554421186c3042537c9f4d578b2d66f0bd290579cee221f2b3567fccb0",
     ["alias", "swap", "evicted-block"]),
    (dict(seed=1, block_size=16, num_slots=2048, sources=2, chunk_size=17),
     "d6e953bd18b3a3f8d79763ca7d3148b2dae7c0ff3cef22ddec7d74480843f1a0", ["swap", "evicted-block"]),
    (dict(seed=3, block_size=4, sources=2, mode="none"),
     "1b8c9440834497160bbd924b5a358ab7ff29d2a3331ff4c5edc04ee4e40943c1", []),
]
PAGED_CAMPAIGN_PIN = "9a30f38f696cc3bf50ea2f7923bb75b64fd67d285a0d90f2ac2fedc7f5184ad2"


def digest_arrays(arrays: dict) -> str:
    """sha256 over every dump key (name, dtype, shape, bytes); the run's wall time is left out."""
    h = hashlib.sha256()
    for key in sorted(arrays):
        value = arrays[key]
        if key == "synth_stats":
            stats = json.loads(value)
            del stats["elapsed_s"]
            value = json.dumps(stats, sort_keys=True)
        if isinstance(value, np.ndarray):
            h.update(f"{key}|{value.dtype}|{value.shape}|".encode() + value.tobytes())
        else:
            h.update(f"{key}|{value!r}".encode())
    return h.hexdigest()


@pytest.mark.parametrize("options, expected", SYNTH_PINS,
                         ids=["default", "paged-swa-partial", "page16-chunk17", "swa-none-48b"])
def test_synth_dump_is_pinned(options, expected):
    synthesis = Synthesis(SynthConfig(**{**SMALL, **options})).run()
    for kind in FAULT_KINDS:
        if kind != "real-kv-byte" or synthesis.sources:
            synthesis.inject(kind, 2)
    assert digest_arrays(synthesis.arrays()) == expected


@pytest.mark.parametrize("options, expected, refused", PAGED_SYNTH_PINS,
                         ids=["block4", "block8-swa-partial", "block16-chunk17", "block4-none"])
def test_paged_synth_dump_is_pinned(options, expected, refused):
    synthesis = Synthesis(SynthConfig(**{**SMALL, **options})).run()
    ran_out = []
    for kind in PAGED_FAULT_KINDS:
        if kind != "real-kv-byte" or synthesis.sources:
            try:
                synthesis.inject(kind, 2)
            except SynthError:
                ran_out.append(kind)
    assert ran_out == refused
    assert digest_arrays(synthesis.arrays()) == expected


DIAGNOSIS_COUNTS = ("diagnosed", "named", "named_or_alternative", "certain_wrong",
                    "faults_diagnosed", "faults_named", "other_causes")


def campaign_digest(report) -> str:
    data = json.loads(render(report, "json"))
    for key in ("elapsed_s", "machine", "jobs", "skipped_backends"):
        del data["campaign"][key]
    # The pin is of the faults and their detection; the diagnosis scores (which follow the
    # diagnosis's wording of causes, not the simulation) are tested in tests/campaign.
    del data["certain_wrong_causes"]
    for row in data["cells"]:
        for key in DIAGNOSIS_COUNTS:
            del row[key]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def test_small_campaign_is_pinned(tiny_campaign):
    # run_campaign(faults_per_kind=2, clean_runs=2, seed=1, backend="numpy", jobs=1)
    assert campaign_digest(tiny_campaign("per-token")[0]) == CAMPAIGN_PIN


def test_small_paged_campaign_is_pinned(tiny_campaign):
    assert campaign_digest(tiny_campaign("paged")[0]) == PAGED_CAMPAIGN_PIN


def test_a_copied_synthesis_hashes_the_kv_it_writes():
    """The campaign injects into ``copy.deepcopy`` of a clean run: the copy's real-KV writes
    must land in the bytes its canary writes hash (a fault then fires only its own checks)."""
    import copy

    from kvcanary.audit import audit

    clean = Synthesis(SynthConfig(**SMALL, page_size=16, sources=2, seed=3)).run()
    synthesis = copy.deepcopy(clean)
    synthesis.inject("stale-reuse", 2)
    result = audit(synthesis.dump(), backend="numpy")
    assert result.total_violations > 0
    assert "verify_real_kv_hash" not in result.counts_by_reason
