"""Ctrl-C and SIGTERM stop every long command at once and cleanly: each test starts a command
in its own process group, waits for its progress, signals the whole group and checks the time
to stop, the exit status, the one line on stderr, that no process is left and that no output
is half-written (the previous file stays, or none appears)."""

from __future__ import annotations

import json
import re
import signal
import sys

import numpy as np
import pytest

import skip_reasons

import kvcanary as kc
from builders import linear_req_to_token, make_context, run_plan
from interrupt_harness import interrupt, snapshot
from kvcanary.dump import save

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="process groups and /proc: Linux only")

STOP_LIMIT_S = 2.0
PROGRESS = r": [1-9]\d*/\d+ \("   # a progress line past its start: the command is at work
SIGNALS = [pytest.param(signal.SIGINT, id="SIGINT"), pytest.param(signal.SIGTERM, id="SIGTERM")]


def tiled_dump(path, requests: int, length: int) -> int:
    """A clean dump of ``requests`` live requests of ``length`` tokens each; returns the
    entries an audit checks. One request is written through the library and its records are
    copied to every other request's slots: a chain does not depend on where its slots are."""
    positions = np.arange(length, dtype=np.int64)
    _, write_plan = run_plan([1], [0], [length], positions.reshape(1, length))
    context = make_context(num_slots=length)
    kc.write(context, write_plan, input_ids=positions * 7 + 3, positions=positions,
             out_cache_loc=positions)
    save(path, canary=np.tile(context.canary_buf, (requests + 1, 1)),
         req_to_token=linear_req_to_token(requests + 1, length),
         req_pool_indices=np.arange(1, requests + 1), seq_lens=np.full(requests, length))
    return requests * length


def earlier_dump(path) -> None:
    """A small dump an interrupted command must leave as it is."""
    save(path, canary=np.zeros((4, 32), np.uint8), req_to_token=np.zeros((2, 1), np.int32),
         req_pool_indices=np.zeros(0, np.int64), seq_lens=np.zeros(0, np.int64))


def assert_clean_stop(stopped, sig, line_pattern: str) -> str:
    name = signal.Signals(sig).name
    assert "Traceback" not in stopped.stderr + stopped.stdout, stopped.stderr
    messages = stopped.messages()
    assert len(messages) == 1, messages
    assert re.fullmatch(line_pattern.replace("SIG", name), messages[0]), messages[0]
    assert stopped.returncode == 128 + sig
    assert stopped.stop_s < STOP_LIMIT_S, f"stopped {stopped.stop_s:.2f} s after {name}"
    assert stopped.alive == [], f"left running: {stopped.alive} (group was {stopped.group})"
    return messages[0]


def json_records(text: str) -> list:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("interrupt-dumps")
    made = {"mid": folder / "mid.npz", "huge": folder / "huge"}
    entries = {"mid": tiled_dump(made["mid"], 64, 4096),
               "huge": tiled_dump(made["huge"], 1024, 4096)}
    return made, entries


@pytest.mark.parametrize("sig", SIGNALS)
def test_campaign(sig, tmp_path):
    args = ["campaign", "--faults-per-kind", 500, "--clean-runs", 100, "--backend", "numpy",
            "--jobs", 2]
    if sig == signal.SIGINT:     # the JSON report on stdout ends with the interrupted record
        args += ["--format", "json"]
    else:                        # an earlier --out report stays as it was
        args += ["--out", "report.md"]
        (tmp_path / "report.md").write_text("an earlier report\n")
    before = snapshot(tmp_path)
    stopped = interrupt(args, sig, PROGRESS, cwd=tmp_path,
                        min_processes=3)
    assert_clean_stop(stopped, sig, r"kvcanary: campaign interrupted by SIG "
                                    r"\([^()]+: \d+/\d+\); "
                      + ("the report" if sig == signal.SIGINT else "report.md")
                      + " not written")
    assert snapshot(tmp_path) == before
    if sig == signal.SIGINT:
        (record,) = json_records(stopped.stdout)
        assert record["record"] == "interrupted" and record["signal"] == "SIGINT"
        assert record["command"] == "campaign" and 0 < record["done"] < record["total"]
    else:
        assert stopped.stdout == ""


@pytest.mark.parametrize("sig", SIGNALS)
def test_audit_jobs(sig, dumps, tmp_path):
    """stderr is not a terminal here: the one line is all it gets."""
    made, _ = dumps
    count = 400
    stopped = interrupt(["audit", "--backend", "numpy", "--jobs", 2, "--format", "json",
                         *[made["mid"]] * count], sig, r'"record": "summary"', cwd=tmp_path,
                        stderr_tty=False, ready_on="stdout", min_processes=3)
    assert_clean_stop(stopped, sig, rf"kvcanary: audit interrupted by SIG "
                                    rf"\([^()]+: \d+/{count}\)")
    assert stopped.stderr.endswith("\n") and stopped.stderr.count("\n") == 1
    records = json_records(stopped.stdout)
    summaries = sum(r["record"] == "summary" for r in records)
    assert 0 < summaries < count
    last = records[-1]
    assert last.pop("at")   # the progress bar's label
    assert last == {"record": "interrupted", "command": "audit",
                    "signal": signal.Signals(sig).name, "done": summaries, "total": count,
                    "dumps_reported": summaries, "dumps": count}
    assert all(r["record"] != "interrupted" for r in records[:-1])


@pytest.mark.parametrize("sig", SIGNALS)
def test_audit_single_dump(sig, dumps, tmp_path):
    made, entries = dumps
    entries = entries["huge"]
    args = ["audit", "--backend", "numpy", made["huge"]]
    if sig == signal.SIGTERM:
        args += ["--format", "json"]
    stopped = interrupt(args, sig, PROGRESS, cwd=tmp_path)
    assert_clean_stop(stopped, sig, rf"kvcanary: audit interrupted by SIG "
                                    rf"\([^()]*huge[^()]*: \d+/{entries}\)")
    if sig == signal.SIGTERM:
        (record,) = json_records(stopped.stdout)
        assert record["record"] == "interrupted" and record["dumps_reported"] == 0
        assert 0 < record["done"] < record["total"] == entries
    else:
        assert stopped.stdout == ""


SYNTH = ["--requests", 2000, "--slots", 65536, "--max-running", 64, "--verify-every", 0,
         "--prompt-len", "200..600", "--output-len", "50..200"]


@pytest.mark.parametrize("sig, out, earlier", [
    pytest.param(signal.SIGINT, "out.npz", True, id="SIGINT-npz-replacing"),
    pytest.param(signal.SIGTERM, "out", True, id="SIGTERM-directory-replacing"),
    pytest.param(signal.SIGINT, "out.safetensors", False, id="SIGINT-safetensors-new"),
    pytest.param(signal.SIGTERM, "out.npz", False, id="SIGTERM-npz-new"),
])
def test_synth(sig, out, earlier, tmp_path):
    pytest.importorskip("safetensors", reason=skip_reasons.SAFETENSORS)
    if earlier:
        earlier_dump(tmp_path / out)
    before = snapshot(tmp_path)
    force = ["--force"] if earlier else []
    stopped = interrupt(["synth", out, *SYNTH, *force], sig,
                        PROGRESS, cwd=tmp_path)
    assert_clean_stop(stopped, sig, rf"kvcanary: synth interrupted by SIG "
                                    rf"\([^()]+: \d+/2000\); {out} not written")
    assert snapshot(tmp_path) == before
    assert stopped.stdout == ""



@pytest.mark.parametrize("sig", SIGNALS)
def test_demo(sig, tmp_path):
    """About a second of work: the signal lands while it synthesises its workload."""
    (tmp_path / "kept").mkdir()
    earlier_dump(tmp_path / "kept" / "clean.npz")
    before = snapshot(tmp_path)
    stopped = interrupt(["demo", "--backend", "numpy", "--keep", "kept", "--force"], sig,
                        PROGRESS, cwd=tmp_path)
    assert_clean_stop(stopped, sig, r"kvcanary: demo interrupted by SIG "
                                    r"\(synth: [^()]+: \d+/48\)")
    assert snapshot(tmp_path) == before
