"""The coverage campaign: a small campaign meets every target through the library and the
CLI, lists what the canary is not designed to see with the reason, reproduces its runs from
the printed commands, and fails (naming the miss) when a detector is broken."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
from click.testing import CliRunner

from kvcanary import campaign
from kvcanary.campaign import (
    FAULT_PHASE,
    HIGH,
    LOW,
    PER_TOKEN,
    RULES,
    CampaignError,
    designed,
    render,
    run_campaign,
    run_fault_task,
)
from kvcanary.campaign import runner
from kvcanary.cli.main import main
from kvcanary.format.consts import FailReason
from kvcanary.dump import load
from kvcanary.synth import MODES, TARGET_CLASSES, faults_from_dump

SMALL = dict(faults_per_kind=10, clean_runs=5, seed=3, backend="numpy")


@pytest.fixture(scope="module")
def report():
    return run_campaign(**SMALL, jobs=2)


def test_small_campaign_meets_every_target(report):
    assert report.passed, report.failures()
    assert report.backends == ["numpy"] and "cupy" in report.skipped_backends
    assert report.false_positive_count == 0
    assert report.clean_audits == SMALL["clean_runs"] * len(RULES)
    assert report.prefault_audits == report.fault_runs * len(RULES)
    assert report.unattributed == 0 and report.miss_count == 0
    for target, kind, mode, scope in PER_TOKEN.cells():
        for rules in RULES:
            cell = report.cell("numpy", rules, target, kind, mode, scope)
            assert cell.injected >= SMALL["faults_per_kind"], (target, kind, mode, scope)
            should, _ = designed(kind, mode, scope, rules, target)
            if should:
                assert cell.visible == cell.injected and cell.detected == cell.visible
                assert cell.sites >= cell.visible
            else:
                assert cell.visible == 0 and cell.stray == 0 and not cell.fired
    # Shared records are checked in every request row that maps them.
    assert report.cell("numpy", "kvcanary", "shared", "token", "all").multi_row > 0
    assert report.cell("numpy", "kvcanary", "interior", "token", "all").multi_row == 0


def test_checks_fired_are_the_expected_ones(report):
    fired = report.cell("numpy", "kvcanary", "interior", "token", "all").fired
    assert set(fired) == {"verify_token"}
    fired = report.cell("numpy", "kvcanary", "last", "real-kv-byte", "partial", LOW).fired
    assert set(fired) == {"verify_real_kv_hash"}
    for target in ("interior", "chunk-boundary", "last", "shared"):
        lost = report.cell("numpy", "kvcanary", target, "lost-write", "none")
        assert lost.fired["verify_position"] == lost.injected
        assert lost.fired["verify_chain_hash"] == lost.injected
    # A lost write at position 0 keeps position 0; at a window head the chain check is vacuous.
    head = report.cell("numpy", "kvcanary", "head", "lost-write", "all")
    assert "verify_position" not in head.fired and head.fired["verify_chain_hash"] == head.injected
    edge = report.cell("numpy", "kvcanary", "window-head", "lost-write", "all")
    assert "verify_chain_hash" not in edge.fired and edge.fired["verify_position"] == edge.injected
    zero = report.cell("numpy", "kvcanary", "head", "slot-zero", "partial")
    assert zero.fired == {"slot_zero_in_prefix": zero.injected}


def test_not_designed_rows_carry_their_reason(report):
    text = render(report, "markdown")
    rows = {tuple(cell.strip() for cell in line.strip("|").split("|")[:3]): line
            for line in text.splitlines() if line.startswith("| ") and "---" not in line}
    assert "not designed to see: mode none does not hash real KV" in rows[
        ("head", "real-kv-byte", "none")]
    assert "only the first 16 bytes" in rows[("shared", f"real-kv-byte ({HIGH})", "partial")]
    assert "designed to see" in rows[("cached", f"real-kv-byte ({LOW})", "partial")]
    assert "chain check at a window head is vacuous" in rows[("window-head", "prev-hash", "all")]
    assert "no expected token" in rows[("cached", "token", "none")]
    assert "not the prefix cache's blocks" in rows[("cached", "slot-zero", "partial")]
    assert rows[("window-head", "token", "all")].endswith("| designed to see |")
    compat = text[text.index("--compat (upstream"):]
    assert "SLOT_ZERO_IN_PREFIX audit extension" in compat
    assert "PASS" in text and "0 false positives" in text
    data = json.loads(render(report, "json"))
    assert data["passed"] is True and data["false_positives"]["total"] == 0
    reasons = {(r["target"], r["kind"], r["mode"], r["scope"], r["rules"]): r
               for r in data["cells"]}
    assert reasons[("head", "slot-zero", "all", "", "compat")]["designed_to_see"] is False
    assert reasons[("head", "slot-zero", "all", "", "kvcanary")]["rate"] == 1.0
    assert data["clean_runs"]["lacking_a_class"] == []


def test_deterministic_and_independent_of_jobs(tiny_campaign):
    # The session's smallest campaign (jobs=1; 12 fault runs over 5 rounds) again on 2 jobs.
    one_job, _ = tiny_campaign("per-token")
    again = run_campaign(faults_per_kind=2, clean_runs=2, seed=1, backend="numpy", jobs=2)
    assert again.cells == one_job.cells
    assert again.fault_runs == one_job.fault_runs


def test_every_setting_is_sampled():
    rng = np.random.default_rng(0)
    configs = [PER_TOKEN.sample_config(rng, "all") for _ in range(300)]
    assert {c["page_size"] for c in configs} == {1, 16, 64}
    assert {c["sources"] for c in configs} == {0, 1, 2, 3, 4}
    assert {bool(c["swa_window"]) for c in configs} == {False, True}


def test_printed_command_rebuilds_the_faults(tmp_path):
    config = PER_TOKEN.sample_config(np.random.default_rng(5), "partial")
    config["sources"] = 2
    plan = [[(kind, PER_TOKEN.per_injection[target], target)
             for target in PER_TOKEN.fill_order]
            for kind in ("token", "swap", "real-kv-byte")]
    plan.append([("position+token", 4, "shared-block"), ("alias+prev-hash", 4, "chain-seam")])
    out = run_fault_task({"index": 0, "config": config, "backends": ["numpy"], "plan": plan})
    assert len(out["injections"]) == 4 and not out["misses"]
    for index, done in enumerate(out["injections"]):
        # Classes with fewer free entries than asked get what there is; the command names
        # the counts placed, so it rebuilds the same faults.
        assert ({"interior", "last", "cached"} <= {target for _, _, target in done}
                or {target for _, _, target in done} == {"shared-block", "chain-seam"})
        path = tmp_path / f"r{index}.npz"
        command = campaign.synth_command(config, done).replace("repro.npz", str(path))
        args = shlex.split(command)
        assert args[:2] == ["kvcanary", "synth"]
        result = CliRunner().invoke(main, args[1:])
        assert result.exit_code == 0, result.output
        faults = faults_from_dump(load(str(path)))
        assert [(f.kind, f.target, f.request_row, f.position, f.slot)
                for f in faults] == out["targets"][index]
    assert sum(map(len, out["targets"])) == sum(
        cell.injected for key, cell in out["cells"].items() if "|kvcanary|" in key)


def drop_token_findings(monkeypatch):
    """A broken detector: the audit loses every row with the token bit."""
    real = runner.audit

    def broken(*args, **kwargs):
        result = real(*args, **kwargs)
        result.findings = [f for f in result.findings
                           if not f.violation.fail_reason_bits & FailReason.VERIFY_TOKEN_MISMATCH]
        return result

    monkeypatch.setattr(runner, "audit", broken)


def test_broken_detector_fails_the_campaign_and_names_the_miss(monkeypatch):
    drop_token_findings(monkeypatch)
    broken = run_campaign(faults_per_kind=5, clean_runs=0, seed=1, backend="numpy", jobs=1)
    assert not broken.passed
    failures = broken.failures()
    assert any(f.startswith("token at head entries in mode") and "were missed" in f
               for f in failures)
    assert not any(f.startswith("position at") for f in failures)
    assert broken.miss_count >= 5 * len(MODES) * len(RULES) * (len(TARGET_CLASSES) - 1)
    miss = broken.misses[0]
    assert miss["kind"] == "token" and miss["fired"] == [] and miss["sites"]
    assert "--seed" in miss["reproduce"] and "kvcanary audit" in miss["reproduce"]
    text = render(broken, "text")
    assert "FAIL" in text and "missed token" in text and "reproduce: kvcanary synth" in text


def test_cli_campaign_pass_and_formats(tmp_path):
    runner = CliRunner()
    out = tmp_path / "coverage.md"
    # The options reach the campaign and its report the files; the targets themselves are
    # the library tests' (the small campaign above).
    result = runner.invoke(main, ["campaign", "--faults-per-kind", "2", "--clean-runs", "2",
                                  "--seed", "2", "--backend", "numpy", "--format", "markdown",
                                  "--out", str(out), "--jobs", "1"])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output
    text = out.read_text()
    assert text.startswith("## kvcanary coverage campaign")
    assert "| head | token | none |" in text and "### False positives" in text
    assert "totals by target class" in text
    result = runner.invoke(main, ["campaign", "--faults-per-kind", "1", "--clean-runs", "1",
                                  "--backend", "numpy", "--format", "json", "--jobs", "1"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["passed"] is True


def test_cli_campaign_exit_1_on_a_miss(monkeypatch):
    drop_token_findings(monkeypatch)
    result = CliRunner().invoke(main, ["campaign", "--faults-per-kind", "3", "--clean-runs", "0",
                                       "--backend", "numpy", "--jobs", "1"])
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output and "missed token" in result.output


@pytest.mark.parametrize("args, name", [
    (["--faults-per-kind", "0"], "--faults-per-kind"),
    (["--clean-runs", "-1"], "--clean-runs"),
    (["--jobs", "0"], "--jobs"),
    (["--seed", "-4"], "--seed"),
    (["--backend", "tpu"], "--backend"),
    (["--format", "html"], "--format"),
    (["--out", "/nonexistent-folder/coverage.md"], "--out"),
])
def test_cli_campaign_bad_input_is_exit_2(args, name):
    result = CliRunner().invoke(main, ["campaign", *args])
    assert result.exit_code == 2
    assert name in result.output
    assert "Traceback" not in result.output


def test_library_rejects_bad_options():
    with pytest.raises(CampaignError, match="--faults-per-kind"):
        run_campaign(faults_per_kind=0)
    with pytest.raises(CampaignError, match="--format"):
        render(None, "html")


def test_cupy_backend_without_a_device_is_exit_2():
    from kvcanary.backends.cuda import CudaUnavailable, require_cupy

    try:
        require_cupy()
    except CudaUnavailable:
        result = CliRunner().invoke(main, ["campaign", "--backend", "cupy"])
        assert result.exit_code == 2 and "--backend cupy" in result.output
    else:
        pytest.skip("a CUDA device is usable here")


@pytest.mark.parametrize("layout", ["per-token", "paged"])
def test_progress_only_grows_and_reaches_100_percent_once(layout, tiny_campaign):
    report, calls = tiny_campaign(layout)   # faults_per_kind=2, clean_runs=2
    assert [c for c in calls if c[0] == "clean runs"][-1] == ("clean runs", 2, 2)
    faults = [c for c in calls if c[0] == FAULT_PHASE]
    assert report.rounds > 1  # a round fell short, planned more runs, and the count still grew
    # One total, never revised; counts that never go back; the total reached once, last.
    assert len({total for _, _, total in faults}) == 1
    done = [d for _, d, _ in faults]
    assert done == sorted(done)
    assert [d == faults[0][2] for d in done].count(True) == 1 and done[-1] == faults[0][2]


def test_help_says_how_long_the_default_campaign_takes():
    result = CliRunner().invoke(main, ["campaign", "--help"])
    assert result.exit_code == 0
    assert "about ten minutes" in " ".join(result.output.split())


def _diagnosis_totals(report, rules="kvcanary"):
    from kvcanary.campaign.model import Cell

    totals = {}
    for (backend, r, target, kind, _, _), cell in report.cells.items():
        if (backend, r) == ("numpy", rules):
            totals.setdefault(kind, Cell()).add(cell)
    return totals


def test_every_certain_diagnosis_at_a_fault_names_its_true_cause(report):
    """Over the whole campaign, both rule sets: a finding at a fault's site that says its
    cause is certain names the fault's cause (pairs, where two faults meet, aside)."""
    from kvcanary.campaign.causes import TRUE_CAUSE

    assert sum(c.certain_wrong for c in report.cells.values()) == 0, report.certain_wrong
    for rules in RULES:
        totals = _diagnosis_totals(report, rules)
        for kind in PER_TOKEN.kinds:
            assert kind in TRUE_CAUSE, kind
            if totals[kind].visible:   # (slot-zero is invisible under --compat)
                assert totals[kind].diagnosed > 0 and totals[kind].named > 0, (kind, rules)


def test_the_campaign_renders_its_own_diagnosis_table(report):
    text = render(report, "markdown")
    assert "### Diagnoses: numpy backend, kvcanary rules" in text
    row = next(line for line in text.splitlines()
               if line.startswith("| token | `wrong-token` | interior |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    c = report.cells
    interior = [cell for (b, r, t, k, _, _), cell in c.items()
                if (b, r, t, k) == ("numpy", "kvcanary", "interior", "token")]
    assert cells[3] == str(sum(x.visible for x in interior))        # detection ...
    assert cells[5] == str(sum(x.diagnosed for x in interior))      # ... and cause
    assert cells[9] == "0"
    data = json.loads(render(report, "json"))
    assert data["certain_wrong_causes"]["count"] == 0
    assert all("named" in row and "other_causes" in row for row in data["cells"])


def test_a_certain_wrong_cause_fails_the_campaign(monkeypatch):
    import dataclasses

    from kvcanary.findings.diagnosis import Diagnosis

    real_audit = runner.audit

    def misdiagnosing(d, **kwargs):
        result = real_audit(d, **kwargs)
        wrong = Diagnosis("slot-zero", "always slot zero", certain=True)
        result.findings[:] = [dataclasses.replace(f, diagnosis=wrong)
                              for f in result.findings]
        return result

    monkeypatch.setattr(runner, "audit", misdiagnosing)
    broken = run_campaign(faults_per_kind=1, clean_runs=0, seed=1, backend="numpy", jobs=1)
    assert any("state a cause as certain that is not the fault's" in f
               for f in broken.failures())
    wrong = broken.certain_wrong[0]
    assert wrong["named"] == "slot-zero" and "kvcanary synth" in wrong["reproduce"]
    assert "certain wrong cause for" in render(broken, "text")
