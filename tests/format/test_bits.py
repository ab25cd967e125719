"""The FailReason bits as plain ints are declared once (kvcanary/format/bits.py); no other
module redeclares an ``int(FailReason.X)`` alias of its own."""

import ast
from pathlib import Path

from kvcanary.format import bits
from kvcanary.format.consts import FailReason

PACKAGE = Path(__file__).resolve().parents[2] / "kvcanary"


def test_each_bit_is_its_fail_reason():
    for reason in FailReason:
        assert getattr(bits, reason.name) == int(reason)
        assert type(getattr(bits, reason.name)) is int
    assert bits.WRITE_MISMATCH == int(FailReason.WRITE_TOKEN_MISMATCH
                                      | FailReason.WRITE_POSITION_MISMATCH)


def test_no_module_redeclares_a_bit():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() == "format/bits.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", None) == "int"
                    and "FailReason" in ast.unparse(node.value)):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: "
                             f"{ast.unparse(node)}")
    assert not found, found
