"""Pins: synth and campaign outputs are a function of the seed and options only, bit for bit.
A refactor of the simulation must leave every digest here unchanged; a deliberate change of
the simulation (or of its random draws) updates them, and says so in its commit."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from kvcanary.campaign import render, run_campaign
from kvcanary.synth import FAULT_KINDS, SynthConfig, Synthesis

SMALL = dict(requests=24, num_slots=1024, max_running=8, prompt_len=(8, 48), output_len=(4, 16),
             shared_prefix_len=(16, 40))

SYNTH_PINS = [
    (dict(seed=0), "c510ca14474421dfd36037d280bd662d6d492a1b1a798ac898216ed0287d537a"),
    (dict(seed=5, page_size=4, swa_window=24, sources=3, mode="partial"),
     "c9f6a801296219990c4b82dd6a3aacc6af087dc7fa7b0bed02737772bf147052"),
    (dict(seed=1, page_size=16, num_slots=2048, sources=2, chunk_size=17),
     "9a51ac899fd9702d9940f09c47fa148cbdea8722cfa66a7a58af215761e39b4d"),
    (dict(seed=2, swa_window=40, sources=4, mode="none", bytes_per_token=48),
     "7fd6a991122af3cf6c3b5baf5ed37ef82517bd646d0c6d2e331ad12349b6e106"),
]
CAMPAIGN_PIN = "8f7787704a162378535e1bb89f59b0d669d469d97ebb600f5dc01c2f5d7e4210"


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


def test_small_campaign_is_pinned():
    report = run_campaign(faults_per_kind=2, clean_runs=2, seed=1, backend="numpy", jobs=1)
    data = json.loads(render(report, "json"))
    for key in ("elapsed_s", "machine", "jobs", "skipped_backends"):
        del data["campaign"][key]
    text = json.dumps(data, sort_keys=True)
    assert hashlib.sha256(text.encode()).hexdigest() == CAMPAIGN_PIN


def test_a_copied_synthesis_hashes_the_kv_it_writes():
    """The campaign injects into ``copy.deepcopy`` of a clean run: the copy's real-KV writes
    must land in the bytes its canary writes hash (a fault then fires only its own checks)."""
    import copy

    from kvcanary.audit import audit
    from kvcanary.campaign import _dump

    clean = Synthesis(SynthConfig(**SMALL, page_size=16, sources=2, seed=3)).run()
    synthesis = copy.deepcopy(clean)
    synthesis.inject("stale-reuse", 2)
    result = audit(_dump(synthesis.arrays()), backend="numpy")
    assert result.total_violations > 0
    assert "verify_real_kv_hash" not in result.counts_by_reason
