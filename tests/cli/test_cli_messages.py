"""The command line's messages and options: one error style, options validated by name,
synth's OUT rules, what demo shows and keeps, progress that ends at 100% exactly, and
``python -m kvcanary``."""

from __future__ import annotations

import io
import re
import os
import subprocess
import sys

import numpy as np
import pytest

import skip_reasons
from click.testing import CliRunner

from kvcanary.cli import main
from kvcanary.cli.common import Progress
from kvcanary.synth import Synthesis, SynthConfig, SynthError

SMALL = ["--requests", "12", "--slots", "512", "--max-running", "4", "--prompt-len", "8..24"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvcanary: error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_python_dash_m_runs_the_command_line():
    done = subprocess.run([sys.executable, "-m", "kvcanary", "--version"], capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stdout.startswith("kvcanary, version "), done


@pytest.mark.parametrize("command", [["synth", "x.npz"], ["demo"], ["campaign"]])
@pytest.mark.parametrize("seed", ["-1", str(1 << 63), str(10 ** 30)])
def test_seed_is_validated_by_name(tmp_path, command, seed):
    result = invoke(*command, "--seed", seed)
    assert result.exit_code == 2 and "'--seed'" in result.output, result.output
    assert not (tmp_path / "x.npz").exists()


def test_library_seed_check_names_the_option():
    with pytest.raises(SynthError, match="--seed must be in"):
        SynthConfig(seed=-1).validate()


@pytest.mark.parametrize("name", ["d.npy", "d.zip", "dump.v1"])
def test_synth_refuses_an_unknown_suffix_before_the_run(tmp_path, name):
    one_error_line(invoke("synth", tmp_path / name, *SMALL), name,
                   "unknown dump container suffix")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name,container", [("d.npz", "npz file"), ("d", "directory"),
                                            ("d.safetensors", "safetensors file")])
def test_synth_picks_the_container_by_suffix_and_says_where(tmp_path, name, container):
    result = invoke("synth", tmp_path / name, *SMALL)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"wrote {tmp_path / name} ({container}): ")
    assert (tmp_path / name).is_dir() == (container == "directory")


def test_synth_trailing_slash_means_a_directory(tmp_path):
    result = invoke("synth", f"{tmp_path / 'out.d'}/", *SMALL)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out.d" / "canary.npy").exists()


def test_synth_never_overwrites_without_force(tmp_path):
    target = tmp_path / "d.npz"
    target.write_bytes(b"precious")
    one_error_line(invoke("synth", target, *SMALL), "d.npz", "--force")
    assert target.read_bytes() == b"precious"
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    one_error_line(invoke("synth", folder, *SMALL), "not empty", "--force")
    assert os.listdir(folder) == ["notes.txt"]
    assert invoke("synth", target, *SMALL, "--force").exit_code == 0
    assert target.read_bytes() != b"precious"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert invoke("synth", empty, *SMALL).exit_code == 0


def test_inject_all_skips_what_does_not_apply_and_says_so(tmp_path):
    result = invoke("synth", tmp_path / "d.npz", *SMALL, "--sources", "0", "--inject", "all")
    assert result.exit_code == 0, result.output
    assert "--inject all: skipped real-kv-byte: no real-KV sources (--sources 0)" in result.output
    injected = [line for line in result.output.splitlines() if line.startswith("injected ")]
    assert len(injected) == 8 and not any("real-kv-byte" in line for line in injected)


def test_a_directory_without_a_dump_is_not_a_kvcanary_dump(tmp_path):
    (tmp_path / "stuff").mkdir()
    np.save(tmp_path / "stuff" / "weights.npy", np.zeros(3))
    one_error_line(invoke("audit", tmp_path / "stuff"), "stuff: not a kvcanary dump",
                   "kvcanary_dump_version, canary, req_to_token, req_pool_indices, seq_lens")


def test_demo_keep_prints_the_paths_and_shows_one_finding(tmp_path):
    result = invoke("demo", "--backend", "numpy", "--keep", tmp_path / "kept")
    assert result.exit_code == 0, result.output
    for name in ("clean.npz", "faulty.npz"):
        assert f"kept {tmp_path / 'kept' / name}" in result.output.splitlines()
    lines = result.output.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("what a finding looks")))
    assert lines[at + 1].startswith("kv_canary violation: ")
    assert lines[at + 2].startswith("  at: request row ")
    assert "also breaks the chain link of the next token" in lines[at + 4]


def test_progress_shows_100_percent_only_when_done():
    stream = io.StringIO()
    bar = Progress("work", stream=stream, force=True)
    bar(999, 1000)
    assert stream.getvalue().endswith("999/1000 (99%)")
    bar(1000, 1000)
    bar(1000, 1000)   # a repeated final count is drawn once
    assert stream.getvalue().count("(100%)") == 1


def test_synth_progress_reaches_the_total_exactly_when_the_run_ends():
    calls = []
    Synthesis(SynthConfig(requests=12, num_slots=512, max_running=4, prompt_len=(8, 24),
                          seed=3)).run(progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (12, 12)
    assert all(done < total for done, total in calls[:-1])
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def test_commands_use_only_public_library_names_and_named_exit_codes():
    from pathlib import Path

    cli = Path(__file__).resolve().parents[2] / "kvcanary" / "cli"
    for source in sorted(cli.glob("*.py")):
        text = source.read_text(encoding="utf-8")
        assert not re.search(r"sys\.exit\(\d", text), source.name
        assert not re.search(r"from kvcanary[\w.]* import[^\n]*\b_\w", text), source.name
        assert not re.search(r"\b(dump|audit|synth|campaign|demo|smoke)\._\w", text), source.name


def test_too_many_sources_says_the_bound_is_everywhere_and_how_to_raise_it(tmp_path):
    sources = {f"real_kv_{i}": np.zeros((8, 16), np.uint8) for i in range(5)}
    path = tmp_path / "five.npz"
    np.savez(path, kvcanary_dump_version=np.array(1), canary=np.zeros((8, 32), np.uint8),
             req_to_token=np.zeros((2, 4), np.int32), req_pool_indices=np.array([1]),
             seq_lens=np.array([2]), real_kv_params=np.array([[1, 16, 16]] * 5),
             real_kv_hash_mode=np.array("all"), **sources)
    one_error_line(invoke("audit", path, "--backend", "numpy"), "five.npz: key real_kv_params",
                   "at most 4 RealKvSource entries", "every backend, numpy included",
                   "kvcanary audit --max-real-kv-sources N")
    raised = invoke("audit", path, "--backend", "numpy", "--max-real-kv-sources", "5")
    assert raised.exit_code == 1 and "summary " in raised.output   # audited (zeroed records)


def test_html_into_a_missing_folder_fails_before_any_work(tmp_path):
    """audit and explain check --html's folder first, as synth checks OUT's: one line naming
    the option and the folder, no audit run, no temporary file named."""
    from test_audit import build

    from kvcanary.dump import save

    pytest.importorskip("jinja2", reason=skip_reasons.REPORT)
    dump = save(str(tmp_path / "d.npz"), **build())
    log = tmp_path / "x.log"
    log.write_text("")
    page = tmp_path / "missing" / "r.html"
    for args in (["audit", dump, "--backend", "numpy"], ["explain", log]):
        result = invoke(*args, "--html", page)
        one_error_line(result, f"--html {page}: the folder {page.parent} does not exist")
        assert ".partial" not in result.output and "summary" not in result.output
    # A dangling link into a missing folder: the folder it points into, before any work.
    link = tmp_path / "link.html"
    link.symlink_to(page)
    for args in (["audit", dump, "--backend", "numpy"], ["explain", log]):
        result = invoke(*args, "--html", link)
        one_error_line(result, f"--html {link} (a link to {page}): the folder {page.parent} "
                               "does not exist")
        assert "summary" not in result.output
