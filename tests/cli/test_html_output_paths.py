"""``--html`` never replaces an input (the file itself, a file inside a directory dump, or
either through a link), and a failed page write names the page, not standard output or the
hidden temporary beside it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import kvcanary.report.render as render
from kvcanary.cli.main import main
from kvcanary.dump import save


def small_dump(path) -> str:
    table = np.zeros((2, 4), np.int64)
    table[1] = [1, 2, 3, 4]
    return save(str(path), canary=np.zeros((5, 32), np.uint8), req_to_token=table,
                req_pool_indices=np.array([1]), seq_lens=np.array([4]))


def refused(args, kept: str):
    before = open(kept, "rb").read()
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "an input is never written" in result.output
    assert "Traceback" not in result.output
    assert open(kept, "rb").read() == before
    return result.output


def test_audit_refuses_to_write_the_page_over_its_dump(tmp_path):
    dump = small_dump(tmp_path / "d.npz")
    assert f"--html {dump}: is the input {dump}" in refused(["audit", dump, "--html", dump], dump)


def test_audit_refuses_a_page_inside_a_directory_dump(tmp_path):
    dump = small_dump(tmp_path / "d")
    inside = os.path.join(dump, "seq_lens.npy")
    assert "is inside the input" in refused(["audit", dump, "--html", inside], inside)


def test_audit_refuses_a_link_to_its_dump(tmp_path):
    dump = small_dump(tmp_path / "d.npz")
    link = tmp_path / "report.html"
    link.symlink_to(dump)
    refused(["audit", dump, "--html", str(link)], dump)
    assert link.is_symlink()


def test_explain_refuses_to_write_the_page_over_its_log(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("an ordinary server line\n")
    refused(["explain", str(log), "--html", str(log)], str(log))


@pytest.mark.parametrize("command", ["audit", "explain"])
def test_a_full_disk_is_blamed_on_the_page_not_on_standard_output(tmp_path, monkeypatch,
                                                                  command):
    if command == "audit":
        source = small_dump(tmp_path / "d.npz")
    else:
        source = str(Path(__file__).resolve().parents[1] / "data" / "explain" / "pd-decode.log")
    page = str(tmp_path / "report.html")

    class Full:   # what a full disk does to the page's write
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            raise OSError(28, "No space left on device")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(render, "open", Full, raising=False)
    result = CliRunner().invoke(main, [command, source, "--html", page])
    assert result.exit_code == 2
    assert f"kvcanary: error: {page}: No space left on device" in result.output
    assert "standard output" not in result.output


@pytest.mark.parametrize("where", ["missing-folder/report.html", "dangling"])
def test_an_unwritable_page_names_the_page_not_the_temporary(tmp_path, where):
    dump = small_dump(tmp_path / "d.npz")
    page = tmp_path / where
    if where == "dangling":
        page.symlink_to(tmp_path / "gone" / "report.html")
    result = CliRunner().invoke(main, ["audit", dump, "--html", str(page)])
    assert result.exit_code == 2
    assert ".partial" not in result.output and "Traceback" not in result.output
    assert "report.html" in result.output or "dangling" in result.output


def test_synth_shows_a_newline_in_its_output_path_escaped(tmp_path):
    out = tmp_path / "a\nb.npz"
    result = CliRunner().invoke(main, ["synth", str(out), "--requests", "4", "--slots", "1024",
                                       "--sources", "0"])
    assert result.exit_code == 0, result.output
    wrote = [line for line in result.output.splitlines() if line.startswith("wrote ")]
    assert wrote and "a\\nb.npz" in wrote[0]
