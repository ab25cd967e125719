"""The command line: exit codes, text and JSON Lines output, errors without tracebacks, the
demo, and the installed entry point."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvcanary.cli.main import main
from kvcanary.dump import save

LOG_LINE = re.compile(
    r"^kv_canary violation: launch_tag=(\S+) fail_reason=(\S+) slot_idx=(-?\d+) "
    r"position=(-?\d+) stored_token=(-?\d+) expected_token=(-?\d+) "
    r"stored_chain_hash=(0x[0-9a-f]{16}) expected_aux=(0x[0-9a-f]{16})$")
SMALL = ["--requests", "24", "--slots", "1024", "--max-running", "8", "--prompt-len", "8..40"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def synth(tmp_path, name="d.npz", *extra):
    path = tmp_path / name
    result = invoke("synth", path, *SMALL, *extra)
    assert result.exit_code == 0, result.output
    return path


def digest(path: Path) -> str:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    h = hashlib.sha256()
    for file in files:
        h.update(file.read_bytes())
    return h.hexdigest()


def test_synth_then_audit_clean(tmp_path):
    path = synth(tmp_path)
    before = digest(path)
    result = invoke("audit", path)
    assert result.exit_code == 0, result.output
    assert "CLEAN: checked" in result.output and "kv_canary violation" not in result.output
    assert digest(path) == before   # inputs are never written


def test_audit_text_output_names_row_position_checks_and_cause(tmp_path):
    path = synth(tmp_path, "f.npz", "--inject", "position", "--inject", "alias")
    result = invoke("audit", path)
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    violations = [i for i, line in enumerate(lines) if line.startswith("kv_canary violation:")]
    assert violations
    for i in violations:
        assert LOG_LINE.match(lines[i]), lines[i]
        assert re.match(r"  at: request row \d+ \(batch index \d+\), position \d+, slot \d+",
                        lines[i + 1])
        assert lines[i + 2].startswith("  failed checks: ")
        assert lines[i + 3].startswith("  likely cause: ")
    summary = [line for line in lines if line.startswith("summary ")]
    assert len(summary) == 1 and "VIOLATIONS: checked" in summary[0]


def test_audit_json_lines(tmp_path):
    path = synth(tmp_path, "j.npz", "--inject", "token:2", "--inject", "real-kv-byte")
    result = invoke("audit", path, "--format", "json")
    assert result.exit_code == 1
    records = [json.loads(line) for line in result.output.splitlines()]
    assert records[0]["record"] == "config" and records[-1]["record"] == "summary"
    violations = records[1:-1]
    assert violations and all(r["record"] == "violation" for r in violations)
    keys = {"launch_tag", "fail_reason", "fail_reason_bits", "slot_idx", "position",
            "stored_token", "expected_token", "stored_chain_hash", "expected_aux",
            "request_row", "expected_position", "failed_checks", "likely_cause"}
    for r in violations:
        assert keys <= set(r)
        assert re.fullmatch(r"0x[0-9a-f]{16}", r["stored_chain_hash"])
        assert re.fullmatch(r"0x[0-9a-f]{16}", r["expected_aux"])
    summary = records[-1]
    assert summary["violations"] == len(violations) and summary["entries_checked"] > 0
    assert summary["ring_overflow"] is False and summary["dropped"] == 0
    assert sum(summary["counts_by_tag"].values()) == len(violations)
    assert summary["counts_by_reason"]["verify_token"] >= 2


def test_ring_capacity_overflow_is_reported(tmp_path):
    path = synth(tmp_path, "o.npz", "--inject", "all")
    result = invoke("audit", path, "--ring-capacity", "2", "--format", "json")
    assert result.exit_code == 1
    records = [json.loads(line) for line in result.output.splitlines()]
    summary = records[-1]
    assert len(records) == 2 + 2
    assert summary["ring_overflow"] is True
    assert summary["dropped"] == summary["violations"] - 2 > 0


def test_compat_turns_the_slot_zero_extension_off(tmp_path):
    path = synth(tmp_path, "z.npz", "--inject", "slot-zero")
    assert invoke("audit", path).exit_code == 1
    assert invoke("audit", path, "--compat").exit_code == 0


@pytest.mark.parametrize("name", ["s.safetensors", "npydir"])
def test_other_containers(tmp_path, name):
    path = synth(tmp_path, name, "--page-size", "4", "--swa-window", "16", "--sources", "2",
                 "--mode", "partial")
    result = invoke("audit", path)
    assert result.exit_code == 0, result.output
    assert "SWA window 16" in result.output


def test_several_dumps_in_parallel_processes(tmp_path):
    clean = synth(tmp_path, "a.npz")
    faulty = synth(tmp_path, "b.npz", "--inject", "swap")
    result = invoke("audit", clean, faulty, "--format", "json", "--jobs", "2")
    assert result.exit_code == 1, result.output
    records = [json.loads(line) for line in result.output.splitlines()]
    summaries = [r for r in records if r["record"] == "summary"]
    assert [s["dump"] for s in summaries] == [str(clean), str(faulty)]
    assert [s["violations"] == 0 for s in summaries] == [True, False]


def test_out_of_range_table_entry_is_a_finding_not_a_bad_dump(tmp_path):
    canary = np.zeros((8, 32), np.uint8)
    path = save(str(tmp_path / "oob.npz"), canary=canary,
                req_to_token=np.array([[0, 0], [99, 0]], np.int32),
                req_pool_indices=np.array([1], np.int64), seq_lens=np.array([1], np.int64))
    result = invoke("audit", path)
    assert result.exit_code == 1, result.output
    assert "fail_reason=slot_out_of_range slot_idx=99" in result.output
    assert "points outside the canary buffer" in result.output


def _bad_dumps(tmp_path):
    good = dict(canary=np.zeros((8, 32), np.uint8), req_to_token=np.ones((2, 4), np.int32),
                req_pool_indices=np.array([1], np.int64), seq_lens=np.array([2], np.int64))
    cases = {}

    def raw(name, arrays):   # what save would refuse, written as an engine might by hand
        path = str(tmp_path / name)
        np.savez(path, kvcanary_dump_version=np.array(1), **arrays)
        return path

    missing = dict(good)
    del missing["seq_lens"]
    cases["missing"] = (raw("missing.npz", missing), "key seq_lens")
    cases["dtype"] = (raw("dtype.npz", dict(good, seq_lens=np.array([2.0]))), "key seq_lens")
    cases["shapes"] = (raw("shape.npz", dict(good, seq_lens=np.array([2, 2], np.int64))),
                       "key seq_lens")
    cases["negative"] = (raw("neg.npz", dict(good, seq_lens=np.array([-2], np.int64))),
                         "key seq_lens")
    truncated = save(str(tmp_path / "trunc.npz"), **good)
    data = Path(truncated).read_bytes()
    Path(truncated).write_bytes(data[: len(data) // 3])
    cases["truncated"] = (truncated, "trunc.npz")
    obj = str(tmp_path / "obj.npz")
    np.savez(obj, kvcanary_dump_version=np.array(1), **dict(good, canary=np.array([None] * 8)))
    cases["object"] = (obj, "key canary")
    cases["absent"] = (str(tmp_path / "absent.npz"), "absent.npz")
    zero = save(str(tmp_path / "zero.npz"), **dict(good, seq_lens=np.array([0], np.int64)))
    cases["zero entries"] = (zero, "nothing to check")
    return cases


def test_bad_dumps_exit_2_with_one_line(tmp_path):
    for name, (path, fragment) in _bad_dumps(tmp_path).items():
        result = CliRunner().invoke(main, ["audit", str(path)])
        assert result.exit_code == 2, (name, result.output)
        assert "Traceback" not in result.output, name
        assert not isinstance(result.exception, Exception) or isinstance(result.exception,
                                                                          SystemExit), name
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1, (name, result.output)
        assert lines[0].startswith("kvcanary: error: "), (name, lines[0])
        assert fragment in lines[0] and str(path) in lines[0], (name, lines[0])


def test_usage_errors_exit_2(tmp_path):
    assert invoke("audit").exit_code == 2
    assert invoke("audit", "x.npz", "--format", "xml").exit_code == 2
    result = invoke("synth", tmp_path / "x.npz", "--inject", "bogus")
    assert result.exit_code == 2 and "unknown fault kind 'bogus'" in result.output
    result = invoke("synth", tmp_path / "x.npz", "--bytes-per-token", "20")
    assert result.exit_code == 2 and "--bytes-per-token" in result.output
    result = invoke("synth", tmp_path / "x.npz", "--prompt-len", "a..b")
    assert result.exit_code == 2
    result = invoke("audit", synth(tmp_path), "--backend", "cupy")
    try:
        from kvcanary.backends.cuda import require_cupy

        require_cupy()
    except Exception:
        assert result.exit_code == 2 and "backend cupy is not usable" in result.output


def demo_table(out: str) -> dict:
    from kvcanary.synth import FAULT_KINDS

    table = {line.split()[0]: line.split() for line in out.splitlines()
             if line.split() and line.split()[0] in FAULT_KINDS}
    assert set(table) == set(FAULT_KINDS)
    return table


def test_demo_by_default_hashes_all_real_kv_and_detects_every_fault():
    # The first table a user sees: nothing in it may look like a miss.
    result = invoke("demo")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "in all mode" in out.splitlines()[0]
    assert "clean audit:" in out and "0 violation(s) -> clean" in out
    for kind, row in demo_table(out).items():
        assert row[1] == row[2], row
    assert demo_table(out)["real-kv-byte"][1:3] == ["2", "2"]
    assert "not visible" not in out and "PASS" in out


def test_demo_is_honest_about_partial_mode():
    result = invoke("demo", "--mode", "partial")
    assert result.exit_code == 0, result.output
    out = result.output
    table = demo_table(out)
    assert table["real-kv-byte"][1:3] == ["2", "1"]
    assert "not visible in partial mode" in out
    for kind in table:
        if kind != "real-kv-byte":
            assert table[kind][1] == table[kind][2], table[kind]
    assert "PASS" in out


def test_installed_entry_point_runs_in_a_subprocess(tmp_path):
    script = Path(sys.executable).parent / ("kvcanary.exe" if os.name == "nt" else "kvcanary")
    if not script.exists():
        pytest.skip(f"no installed kvcanary script next to {sys.executable}")
    out = tmp_path / "e.npz"
    done = subprocess.run([str(script), "synth", str(out), *SMALL, "--inject", "lost-write"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([str(script), "audit", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    assert "kv_canary violation: launch_tag=TAIL_K_FULL" in done.stdout
    done = subprocess.run([str(script), "audit", str(tmp_path / "nope.npz")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("kvcanary: error: ")


def test_progress_only_draws_on_a_terminal():
    import io

    from kvcanary.cli.common import Progress

    stream = io.StringIO()
    quiet = Progress("work", stream=stream)   # StringIO is not a terminal
    quiet(1, 2)
    quiet(2, 2)
    quiet.close()
    assert stream.getvalue() == ""
    drawn = Progress("work", stream=stream, force=True)
    drawn(1, 4)
    drawn(4, 4)
    drawn.close()
    assert stream.getvalue() == "\rwork: 1/4 (25%)\rwork: 4/4 (100%)\n"


def test_json_mode_reports_a_bad_dump_as_a_record(tmp_path):
    good = synth(tmp_path, "g.npz")
    result = CliRunner().invoke(main, ["audit", str(good), str(tmp_path / "gone.npz"),
                                       "--format", "json", "-j", "1"])
    assert result.exit_code == 2
    lines = result.output.splitlines()
    assert any(line.startswith("kvcanary: error: ") and "gone.npz" in line for line in lines)
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert [r["record"] for r in records] == ["config", "summary", "error", "total"]
    assert records[2]["dump"].endswith("gone.npz")
    assert (records[3]["dumps"], records[3]["clean"], records[3]["errors"]) == (2, 1, 1)


def test_a_folder_of_dump_files_is_named_as_such_with_how_to_pass_them(tmp_path):
    folder = tmp_path / "dumps"
    folder.mkdir()
    for name in ("a.npz", "b.npz"):
        synth(folder, name)
    result = invoke("audit", folder)
    assert result.exit_code == 2
    message = result.output.strip()
    assert message.startswith(f"kvcanary: error: {folder}: a folder of 2 dump file(s) (.npz)")
    assert f"kvcanary audit {folder / '*.npz'}" in message and "Traceback" not in message


def test_the_total_of_several_dumps_names_the_failing_ones(tmp_path):
    clean = synth(tmp_path, "clean.npz")
    faulty = synth(tmp_path, "faulty.npz", "--inject", "token")
    gone = tmp_path / "gone.npz"
    result = invoke("audit", clean, faulty, gone, "-j", "1")
    assert result.exit_code == 2
    total = result.output.splitlines()[-1]
    assert total.startswith(f"total: 3 dumps: 1 clean, 1 with violations ({faulty}), "
                            f"1 not audited ({gone}); ")
    result = invoke("audit", clean, faulty, gone, "-j", "1", "--format", "json")
    record = json.loads(result.output.splitlines()[-1])
    assert record["dumps_with_violations"] == [str(faulty)]
    assert record["dumps_not_audited"] == [str(gone)]


def test_a_request_row_outside_the_table_is_one_error_not_findings(tmp_path):
    good = synth(tmp_path, "good.npz")
    with np.load(good) as data:
        values = dict(data)
    rows = values["req_to_token"].shape[0]
    values["req_pool_indices"] = values["req_pool_indices"].copy()
    values["req_pool_indices"][1] = rows + 91
    bad = tmp_path / "bad.npz"
    np.savez(bad, **values)
    result = invoke("audit", bad)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"kvcanary: error: {bad}: key req_pool_indices: req_pool_indices[1] = {rows + 91} is "
        f"outside req_to_token, which has {rows} rows"]


def test_synth_lists_a_bounded_number_of_injected_faults(tmp_path):
    from kvcanary.audit import DEFAULT_MAX_FINDINGS

    out = tmp_path / "many.npz"
    big = ["--requests", "400", "--max-running", "128", "--slots", "65536"]
    result = invoke("synth", out, *big, "--inject", "token:1100", "--inject", "alias:2")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert sum(line.startswith("injected token") for line in lines) == DEFAULT_MAX_FINDINGS
    assert lines[-1] == (f"injected faults: the first {DEFAULT_MAX_FINDINGS} of 1102 are listed "
                         "(token 1100, alias 2); the dump's synth_fault_* keys hold every one "
                         "(--max-listed 0 lists all)")
    result = invoke("synth", out, *SMALL, "--inject", "token:5", "--max-listed", "0", "--force")
    assert sum(line.startswith("injected token") for line in result.output.splitlines()) == 5
    assert "are listed" not in result.output


def test_several_dumps_are_audited_in_this_process_by_default(tmp_path, monkeypatch):
    # The default was chosen by measurement (benchmarks/README.md): -j 2 was slower.
    from kvcanary.system import signals as interrupt

    pools = []
    real = interrupt.WorkerPool

    def recording(jobs, **kwargs):
        pools.append(jobs)
        return real(jobs, **kwargs)

    monkeypatch.setattr(interrupt, "WorkerPool", recording)
    dumps = [synth(tmp_path, f"{name}.npz") for name in "abc"]
    assert invoke("audit", *dumps).exit_code == 0
    assert pools == [1]
    assert invoke("audit", *dumps, "-j", "2").exit_code == 0
    assert pools == [1, 2]
