"""The command line lives inside the package: ``python -m kvcanary`` and ``import
kvcanary.cli`` work from a plain checkout, with nothing installed and no path mapping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_python_m_kvcanary_help_from_a_checkout(tmp_path):
    result = _run("-m", "kvcanary", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Usage: kvcanary" in result.stdout and "campaign" in result.stdout


def test_import_kvcanary_cli_from_a_checkout(tmp_path):
    result = _run("-c", "import kvcanary.cli, kvcanary; print(kvcanary.cli.__file__)",
                  cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).parent == ROOT / "kvcanary" / "cli"
