"""Every kvcanary error is one of the family in kvcanary/format/errors.py, and each prefix is
written there once: the engine guards' errors too (``GuardError``), whose messages never spell
``kvcanary: `` by hand."""

import ast
import pickle
from pathlib import Path

import pytest

import skip_reasons

from kvcanary.format import errors
from kvcanary.format.errors import CanaryRuntimeError, GuardError

PACKAGE = Path(__file__).resolve().parents[2] / "kvcanary"


def test_guard_error_is_a_runtime_error_of_the_family():
    err = GuardError("this guard is already active", finding="f")
    assert isinstance(err, CanaryRuntimeError) and isinstance(err, RuntimeError)
    assert str(err) == "kvcanary: this guard is already active"
    assert err.detail == "this guard is already active" and err.finding == "f"
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.finding == "f"


def test_the_transformers_guard_raises_the_family_error():
    pytest.importorskip("torch", reason=skip_reasons.transformers_extra("torch"))
    pytest.importorskip("transformers", reason=skip_reasons.transformers_extra("transformers"))
    from kvcanary.integrations import transformers as kvt
    assert kvt.GuardError is GuardError


def _prefixed_literals(path: Path) -> list:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings):
            text = node.value
            if any(text.startswith(p) for p in (errors.ERROR_PREFIX, errors.GUARD_PREFIX)):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {text[:40]!r}")
    return found


def test_no_module_but_errors_writes_an_error_prefix():
    # The command line's own style ("kvcanary: error: ...") is cli/common's; everything else
    # takes its prefix from its error class.
    found = [hit for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "errors.py" and "cli" not in path.parts
             for hit in _prefixed_literals(path)]
    assert not found, found
