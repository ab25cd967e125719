"""The public surface documents itself: every public function and type of ``kvcanary`` has a
docstring that stands on its own (more than one line for the launches and the types they
take), and the examples in them run as printed."""

from __future__ import annotations

import doctest
import inspect

import pytest

import kvcanary
from kvcanary.api import launches as api
from kvcanary.findings import causes
from kvcanary.format import hashing, rules
from kvcanary.model import types

LAUNCHES = ("plan", "write", "verify")
TYPES = ("CanaryContext", "VerifyPlan", "WritePlan", "ViolationLog", "RealKvSource")


@pytest.mark.parametrize("name", [n for n in kvcanary.__all__
                                  if callable(getattr(kvcanary, n))])
def test_every_public_callable_has_a_docstring(name):
    doc = inspect.getdoc(getattr(kvcanary, name)) or ""
    assert doc and not doc.startswith("Enum where members"), name
    if name in LAUNCHES + TYPES:
        assert len(doc.splitlines()) >= 5, name
    if name in LAUNCHES:
        assert ">>>" in doc and "in place" in doc, name


@pytest.mark.parametrize("module", [api, types, hashing, rules, causes],
                         ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
