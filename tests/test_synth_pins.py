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
    (dict(seed=0), "c528542a9f81446db36d6b470e70a79a528f3f7423a1c1e5eb2e262eef34875c"),
    (dict(seed=5, page_size=4, swa_window=24, sources=3, mode="partial"),
     "129ff2c63c492fdfa08ccebba3969e9f7e68fd98ac18a4117c70131d2fbd37dc"),
    (dict(seed=1, page_size=16, num_slots=2048, sources=2, chunk_size=17),
     "46b59aa71ed131786be7dc298c02f640e5faddbfbacba20680db2bb36001f440"),
    (dict(seed=2, swa_window=40, sources=4, mode="none", bytes_per_token=48),
     "e90901627d5620e9d6c3eeb05d4bf2bf0c956228873764da0d6aa75e5ec0ecf3"),
]
CAMPAIGN_PIN = "e8517952b2a109bda639ad148a5f8c907c836dc2c1997d230219ae25c48beba3"


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
