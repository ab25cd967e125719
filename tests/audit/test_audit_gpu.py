"""The audit and synth on the CUDA backend agree with the numpy reference. Skipped, with the
reason, when cupy sees no device."""

from __future__ import annotations

import pytest

from kernel_harness.gpu import require_gpu
from kvcanary.audit import audit
from kvcanary.dump import load, save
from kvcanary.synth import FAULT_KINDS, Synthesis, SynthConfig, faults_from_dump, score

pytestmark = pytest.mark.gpu

SMALL = dict(requests=24, num_slots=1024, max_running=8, prompt_len=(8, 40), sources=2)


def _findings(result):
    return sorted((f.kind, f.request_row, f.position, f.sweep_index, f.violation.to_dict()["fail_reason"],
                   f.violation.slot_idx, f.cause) for f in result.findings)


@pytest.mark.parametrize("options", [dict(), dict(page_size=4, swa_window=16, mode="partial")])
def test_cupy_audit_matches_numpy(tmp_path, options):
    require_gpu()
    synthesis = Synthesis(SynthConfig(**SMALL, **options)).run()
    for kind in FAULT_KINDS:
        synthesis.inject(kind)
    d = load(save(str(tmp_path / "d.npz"), **synthesis.arrays()))
    on_cpu = audit(d, backend="numpy")
    on_gpu = audit(d, backend="cupy")
    assert on_gpu.backend == "cupy" and on_gpu.unattributed == 0
    assert on_gpu.total_violations == on_cpu.total_violations
    assert on_gpu.counts_by_reason == on_cpu.counts_by_reason
    assert _findings(on_gpu) == _findings(on_cpu)
    assert all(o.detected or not o.visible for o in score(faults_from_dump(d), on_gpu))


def test_cupy_synth_writes_the_same_canary(tmp_path):
    require_gpu()
    a = Synthesis(SynthConfig(**SMALL)).run().arrays()
    b = Synthesis(SynthConfig(**SMALL, backend="cupy")).run().arrays()
    assert a["canary"].tobytes() == b["canary"].tobytes()
