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
    (dict(seed=0), "edf19ed04df0f647e1e7f1f3fc7a667232b3c663cca2ef7ebd62801c9cab444d"),
    (dict(seed=5, page_size=4, swa_window=24, sources=3, mode="partial"),
     "2a1f9743e70163447da8a8c6dc71dcf088e73e07e47c4d8ca015b18b6ff8697b"),
    (dict(seed=1, page_size=16, num_slots=2048, sources=2, chunk_size=17),
     "76df25110302bd9cba3c2fae4171edf3c690e446e548cfe2b2e29e5c4dd21f8f"),
    (dict(seed=2, swa_window=40, sources=4, mode="none", bytes_per_token=48),
     "e00b5d8690d6e55d9a85e6304117f6f6ae437a11359ba307abb50d20335a468f"),
]
CAMPAIGN_PIN = "d81bce76e027a3173872857a6032416dea32a40d05cd845573e48a063ab7a556"


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
