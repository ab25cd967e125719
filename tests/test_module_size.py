"""No module over 500 lines: a module that grows past the cap is split by what its parts are
(the failure names the module and its length)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def too_long(paths) -> list:
    lengths = ((path, len(path.read_text(encoding="utf-8").splitlines())) for path in paths)
    return [f"{path.relative_to(ROOT)}: {n} lines" for path, n in lengths if n > MAX_LINES]


def sources() -> list:
    return sorted([*(ROOT / "kvcanary").rglob("*.py"), *(ROOT / "kernels").glob("*.cu*"),
                   *(ROOT / "kernels").glob("*.h")])


def test_no_module_passes_the_cap():
    assert sources(), "no sources found"
    found = too_long(sources())
    assert not found, found


@pytest.mark.parametrize("lines, flagged", [(MAX_LINES, False), (MAX_LINES + 1, True)])
def test_the_cap_is_500_lines(tmp_path, monkeypatch, lines, flagged):
    module = tmp_path / "long.py"
    module.write_text("x = 1\n" * lines)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert bool(too_long([module])) is flagged
