"""The coverage campaign over paged engines (``--layout paged``): a small campaign meets every
target for every paged fault kind, its printed commands rebuild the faults with
``synth --block-size``, and a broken detector fails it."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
from click.testing import CliRunner

from kvcanary.campaign import (
    PAGED,
    RULES,
    designed,
    render,
    run_campaign,
    run_fault_task,
    synth_command,
)
from kvcanary.cli.main import main
from kvcanary.format.consts import FailReason
from kvcanary.dump import load
from kvcanary.synth import PAGED_FAULT_KINDS, faults_from_dump
from kvcanary.synth.fault_kinds import default_target

SMALL = dict(faults_per_kind=8, clean_runs=4, seed=4, backend="numpy", layout="paged")


@pytest.fixture(scope="module")
def report():
    return run_campaign(**SMALL, jobs=2)


def test_small_paged_campaign_meets_every_target(report):
    assert report.passed, report.failures()
    assert report.false_positive_count == 0 and report.clean_audits == 4 * len(RULES)
    assert {kind for _, kind, _, _ in PAGED.cells()} == set(PAGED_FAULT_KINDS)
    for target, kind, mode, scope in PAGED.cells():
        for rules in RULES:
            cell = report.cell("numpy", rules, target, kind, mode, scope)
            assert cell.injected >= SMALL["faults_per_kind"], (kind, mode, scope)
            if designed(kind, mode, scope, rules, target)[0]:
                assert cell.detected == cell.visible == cell.injected
    text = render(report, "markdown")
    assert text.startswith("## kvcanary coverage campaign, paged layout (block tables)")
    assert "| shared | evicted-block | all |" in text and "block size 4:" in text
    assert json.loads(render(report, "json"))["campaign"]["layout"] == "paged"


def test_paged_workloads_sample_every_block_size():
    rng = np.random.default_rng(0)
    configs = [PAGED.sample_config(rng, "all") for _ in range(100)]
    assert {c["block_size"] for c in configs} == set(PAGED.page_sizes)
    assert all(c["page_size"] == c["block_size"] for c in configs)


def test_printed_command_rebuilds_paged_faults(tmp_path):
    config = PAGED.sample_config(np.random.default_rng(3), "all")
    plan = [[(k, 2, default_target(k)) for k in PAGED_FAULT_KINDS]]
    out = run_fault_task({"index": 0, "config": config, "backends": ["numpy"], "plan": plan})
    assert out["injections"] and not out["misses"]
    command = synth_command(config, out["injections"][0]).replace("repro.npz",
                                                                  str(tmp_path / "r.npz"))
    assert f"--block-size {config['block_size']}" in command and "--page-size" not in command
    result = CliRunner().invoke(main, shlex.split(command)[1:])
    assert result.exit_code == 0, result.output
    d = load(str(tmp_path / "r.npz"))
    assert d.block_size == config["block_size"]
    assert [(f.kind, f.target, f.request_row, f.position, f.slot)
            for f in faults_from_dump(d)] == out["targets"][0]


def test_broken_detector_fails_the_paged_campaign(monkeypatch):
    from kvcanary.campaign import runner as shared   # both layouts audit through it

    real = shared.audit

    def broken(*args, **kwargs):   # loses every finding of a position mismatch
        result = real(*args, **kwargs)
        result.findings = [f for f in result.findings if not f.violation.fail_reason_bits
                           & FailReason.VERIFY_POSITION_MISMATCH]
        return result

    monkeypatch.setattr(shared, "audit", broken)
    failed = run_campaign(faults_per_kind=2, clean_runs=0, seed=1, backend="numpy", jobs=1,
                          layout="paged")
    assert not failed.passed
    assert any(f.startswith("evicted-block at head entries in mode") for f in failed.failures())


def test_cli_layout_option():
    result = CliRunner().invoke(main, ["campaign", "--layout", "vertical"])
    assert result.exit_code == 2 and "--layout" in result.output
