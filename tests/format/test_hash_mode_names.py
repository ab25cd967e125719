"""A real-KV hash mode name is parsed in one place (``RealKvHashMode.from_name``): dumps,
synth options, audit results and the engine guard all read it there."""

import ast
from pathlib import Path

import pytest

from kvcanary.format.consts import HASH_MODE_NAMES, RealKvHashMode

PACKAGE = Path(__file__).resolve().parents[2] / "kvcanary"


@pytest.mark.parametrize("name, mode", [("none", RealKvHashMode.NONE),
                                        ("partial", RealKvHashMode.PARTIAL),
                                        ("ALL", RealKvHashMode.ALL),
                                        (" Partial\n", RealKvHashMode.PARTIAL)])
def test_from_name_reads_each_mode_in_any_case(name, mode):
    assert RealKvHashMode.from_name(name) is mode


@pytest.mark.parametrize("name", ["", "full", "2", "al l"])
def test_from_name_refuses_other_names_naming_the_three(name):
    with pytest.raises(ValueError, match=r"^must be none, partial or all, got "):
        RealKvHashMode.from_name(name)


def test_the_names_follow_the_enum_order():
    # The campaign's pins index the modes by this order.
    assert HASH_MODE_NAMES == ("none", "partial", "all")


def test_no_module_parses_a_mode_name_itself():
    # RealKvHashMode[...] by name, or a table of names to modes, is a second parser.
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                    and node.value.id == "RealKvHashMode"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
            if isinstance(node, ast.Dict) and any(
                    isinstance(v, ast.Attribute) and getattr(v.value, "id", "") == "RealKvHashMode"
                    for v in node.values):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    found = [f for f in found if not f.startswith("kvcanary/format/consts.py")]
    assert not found, found
