"""The README's library example runs as printed and finds the remapping bug it plants."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_library_example_reports_the_planted_remap():
    pytest.importorskip("jax", reason="the example's bf16 KV buffer is a jax array")
    code = re.search(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S).group(1)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True)
    lines = result.stdout.splitlines()
    assert lines, "the example printed no violation"
    assert all(line.startswith("kv_canary violation: launch_tag=TAIL_K_FULL") for line in lines)
    # Position 3 now points at slot 12, which holds position 2's record.
    assert any("slot_idx=12 position=2" in line and "verify_position" in line for line in lines)


def test_readme_names_both_commands():
    text = README.read_text(encoding="utf-8")
    assert "pip install . && kvcanary demo" in text
    assert "pip install -e '.[test]' && python -m pytest -q -rs" in text
