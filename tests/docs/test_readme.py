"""The README's library example runs as printed and finds the remapping bug it plants."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


# Run the example where importing either framework fails, as after `pip install .` alone.
WITHOUT_FRAMEWORKS = "import sys; sys.modules.update(jax=None, torch=None)\n"


def library_example() -> str:
    return re.search(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S).group(1)


def run_example(code: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def assert_reports_the_remap(lines):
    assert lines, "the example printed no violation"
    rows = [line for line in lines if not line.startswith("  ")]
    assert all(line.startswith("kv_canary violation: launch_tag=TAIL_K_FULL") for line in rows)
    # Position 3 now points at slot 12, which holds position 2's record: the finding says
    # where (position 3) and why (the mapping is shifted).
    assert any("slot_idx=12 position=2" in line and "verify_position" in line for line in rows)
    assert "  at: request row 1 (batch index 0), position 3, slot 12" in lines
    assert any(line.startswith("  likely cause:") and "shifted by -1" in line for line in lines)
    # The README shows what it prints.
    shown = re.search(r"It prints [^\n]*:\n\n```\n(.*?)```", README.read_text(encoding="utf-8"),
                      re.S).group(1)
    assert lines == shown.splitlines()


def test_readme_library_example_runs_with_numpy_alone():
    code = library_example()
    assert not re.search(r"^\s*(import|from) (jax|torch)", code, re.M)
    assert_reports_the_remap(run_example(WITHOUT_FRAMEWORKS + code))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_readme_library_example_variants_give_the_same_findings(framework):
    pytest.importorskip(framework, reason=f"the example's {framework} variant needs {framework}")
    code = library_example()
    variant = re.search(rf"^#\s+{framework}:\s+(k_buffer = .*)$", code, re.M).group(1)
    imports = {"torch": "import torch", "jax": "import jax, jax.numpy as jnp"}[framework]
    numpy_line = re.search(r"^k_buffer = .*$", code, re.M).group(0)
    lines = run_example(code.replace(numpy_line, f"{imports}\n{variant}"))
    assert_reports_the_remap(lines)
    # The KV bytes differ, the canary's findings do not.
    assert lines == run_example(WITHOUT_FRAMEWORKS + code)


def test_readme_names_both_commands():
    text = README.read_text(encoding="utf-8")
    assert "pip install . && kvcanary demo" in text
    assert "pip install -e '.[test]' && python -m pytest -q\n" in text
    # Not -rs: the suite lists what did not run itself, once (pytest's list would repeat it).
    assert "pytest -q -rs" not in text
