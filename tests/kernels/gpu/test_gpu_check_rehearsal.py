"""Rehearsal of scripts/gpu-check.sh here, without a GPU: a clean copy of the checkout,
a python that has only what the GPU machine has (numpy, click, pytest, hypothesis and,
when KVCANARY_CUPY_PATHS lists one, the CUDA 13 build of CuPy) and no kvcanary installed.
The script must resolve every import (kvcanary, its CLI, the benchmark, the GPU tests'
collection) and stop fast with one sentence, exit 3, no traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

ROOT = Path(__file__).resolve().parents[3]
# Top-level names in site-packages of the GPU machine's packages and their dependencies.
GPU_MACHINE_PACKAGES = ("numpy", "click", "pytest", "_pytest", "py", "pluggy", "iniconfig",
                        "packaging", "pygments", "hypothesis", "_hypothesis", "sortedcontainers",
                        "attr", "attrs", "exceptiongroup", "tomli")


def _gpu_machine_site(target: Path) -> Path:
    """A site directory linking only the GPU machine's packages (with their metadata, so
    pytest finds hypothesis' plugin)."""
    site_packages = Path(numpy.__file__).resolve().parents[1]
    target.mkdir()
    for entry in site_packages.iterdir():
        stem = entry.name.split("-")[0].split(".")[0].lower()
        if any(stem == name or stem.startswith(name + "_") for name in GPU_MACHINE_PACKAGES):
            (target / entry.name).symlink_to(entry)
    return target


def _cuda13_cupy() -> str | None:
    for path in os.environ.get("KVCANARY_CUPY_PATHS", "").split(os.pathsep):
        if path and any(Path(path).glob("cupy_cuda13x-*.dist-info")):
            return path
    return None


def _clean_checkout(target: Path) -> Path:
    """The tracked files of this working tree, as a fresh clone would have them (with the
    working tree's edits), and nothing built or installed."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: nothing to clone")
    for name in listed.stdout.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def test_gpu_check_stops_with_one_sentence_without_a_gpu(tmp_path):
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and timeout")
    checkout = _clean_checkout(tmp_path / "checkout")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = _gpu_machine_site(tmp_path / "site")
    cupy = _cuda13_cupy()
    paths = [str(site)] + ([cupy] if cupy else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHON=str(venv / "bin" / "python"), PYTHONPATH=os.pathsep.join(paths),
               OUT=str(tmp_path / "out"))
    probe = subprocess.run([env["PYTHON"], "-c", "import kvcanary"], env=env, cwd=tmp_path,
                           capture_output=True, text=True)
    assert probe.returncode != 0, "kvcanary must not be importable outside the checkout"

    started = time.monotonic()
    done = subprocess.run(["bash", str(checkout / "scripts" / "gpu-check.sh")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 3, output
    assert "Traceback" not in output
    stops = [line for line in done.stdout.splitlines() if line.startswith("gpu-check: stopped:")]
    assert len(stops) == 1, output
    if cupy:
        assert stops[0].startswith("gpu-check: stopped: no CUDA device"), output
    else:
        assert stops[0].startswith("gpu-check: stopped: CuPy is not importable"), output
    assert elapsed < 90, f"the preflight took {elapsed:.0f}s"
    assert (tmp_path / "out" / "summary.txt").read_text().splitlines()[-1] == stops[0]
