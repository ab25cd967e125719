"""What the synth tests share: a small workload's options, a run of it, and a dump round
trip (a module, not a fixture: the hypothesis tests call them inside ``@given``)."""

from __future__ import annotations

from kvcanary.dump import load, save
from kvcanary.synth import SynthConfig, Synthesis

SMALL = dict(requests=24, num_slots=1024, max_running=8, prompt_len=(8, 48), output_len=(4, 16),
             shared_prefix_len=(16, 40))


def run(**overrides) -> Synthesis:
    """A small synthesis (``SMALL`` with ``overrides``), run."""
    return Synthesis(SynthConfig(**{**SMALL, **overrides})).run()


def roundtrip(tmp_path, synthesis, name="d.npz"):
    """The synthesis saved as a dump under ``tmp_path`` and loaded back."""
    return load(save(str(tmp_path / name), **synthesis.arrays()))
