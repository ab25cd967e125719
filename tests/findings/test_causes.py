"""One vocabulary of causes (kvcanary.findings.causes.Cause): every cause a diagnosis states
is a member with a description and its evidence, and a cause outside the enum cannot reach a
finding (a Diagnosis refuses it)."""

import ast
import json
from pathlib import Path

import pytest

from kvcanary.findings.causes import Cause
from kvcanary.findings.diagnosis import CAUSES, Diagnosis, diagnose
from kvcanary.format.violations import Violation

PACKAGE = Path(__file__).resolve().parents[2] / "kvcanary"


def test_every_cause_has_a_name_a_description_and_its_evidence():
    assert len({c.value for c in Cause}) == len(Cause)
    for cause in Cause:
        assert cause.value == cause.name.lower().replace("_", "-")
        assert cause.description and cause.evidence, cause.name
    assert CAUSES == tuple(c.value for c in Cause)


def test_a_cause_outside_the_enum_cannot_reach_a_finding():
    with pytest.raises(ValueError, match="not a valid Cause"):
        Diagnosis("corrupted-somehow", "a cause nobody defined")
    with pytest.raises(ValueError, match="not a valid Cause"):
        Diagnosis("overwritten", "text", certain=False, alternatives=("bit-flip",))


def test_a_cause_reads_as_its_name():
    d = Diagnosis("shared-slot", "text", certain=False, alternatives=("overwritten",))
    assert d.cause is Cause.SHARED_SLOT and d.alternatives == (Cause.OVERWRITTEN,)
    assert d.cause == "shared-slot" and {"shared-slot": 1}[d.cause] == 1
    assert (str(d.cause), f"{d.cause}", repr(d.cause)) == ("shared-slot", "shared-slot",
                                                           "'shared-slot'")
    assert json.loads(json.dumps(d.to_dict())) == {
        "cause": "shared-slot", "certain": False, "explanation": "text",
        "alternatives": ["overwritten"]}


def test_the_diagnosis_states_members_of_the_enum():
    # An all-zero stored record failing its chain link, from the row alone.
    assert diagnose(Violation(2, 5, 0, 0, -1, 0, 1, 1)).cause is Cause.NEVER_WRITTEN


def test_every_cause_named_in_the_source_is_a_member():
    # Diagnosis("name", ...) and alternatives=(...) literals anywhere in kvcanary.
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Diagnosis":
                if node.args and isinstance(node.args[0], ast.Constant):
                    names.add((path.name, node.args[0].value))
                for kw in node.keywords:
                    if kw.arg == "alternatives":
                        names.update((path.name, n.value) for n in ast.walk(kw.value)
                                     if isinstance(n, ast.Constant) and isinstance(n.value, str))
    assert names, "no Diagnosis(...) found"
    unknown = sorted(n for n in names if n[1] not in CAUSES)
    assert not unknown, unknown
