"""One vocabulary of causes (kvcanary.findings.causes.Cause): every cause a diagnosis states
is a member with a description and its evidence, and a cause outside the enum cannot reach a
finding (a Diagnosis refuses it)."""

import ast
import json
import string
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


# Keywords of Diagnosis.of that are the diagnosis's own fields, not template evidence.
STATED = {"certain", "alternatives", "related"}


def _views(node, where) -> list:
    """The template views a ``Diagnosis.of`` view argument can name: a string literal, or a
    conditional expression choosing between literals."""
    if isinstance(node, ast.IfExp):
        return _views(node.body, where) + _views(node.orelse, where)
    assert isinstance(node, ast.Constant) and isinstance(node.value, str), \
        f"{where}: the view is a string literal (or a choice between literals)"
    return [node.value]


def _stated_calls(package=PACKAGE):
    """Every ``Diagnosis.of(Cause.X, "view", field=...)`` under ``package``: (file, line,
    cause name, views, evidence keyword names, alternatives node); and (file, line) of each
    Diagnosis made any other way (its text written at the call)."""
    calls, other = [], []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            f, where = node.func, f"{path.name}:{node.lineno}"
            if isinstance(f, ast.Attribute) and f.attr == "of" and \
                    getattr(f.value, "id", None) == "Diagnosis":
                first = node.args[0]
                assert isinstance(first, ast.Attribute) and first.value.id == "Cause", \
                    f"{where}: Diagnosis.of names its cause as Cause.X"
                views = _views(node.args[1], where) if len(node.args) > 1 else [""]
                assert all(k.arg for k in node.keywords), \
                    f"{where}: name the evidence fields (no **fields)"
                alternatives = [k.value for k in node.keywords if k.arg == "alternatives"]
                calls.append((path, node.lineno, first.attr, views,
                              {k.arg for k in node.keywords} - STATED, alternatives))
            elif getattr(f, "id", None) == "Diagnosis" or (
                    isinstance(f, ast.Attribute) and f.attr == "Diagnosis"):
                other.append((path, node.lineno))
    return calls, other


def test_every_cause_named_in_the_source_is_a_member():
    # Diagnosis.of(Cause.X, ..., alternatives=(Cause.Y, ...)) anywhere in kvcanary.
    calls, _ = _stated_calls()
    for path, line, name, _, _, alternatives in calls:
        assert name in Cause.__members__, f"{path.name}:{line}: no Cause.{name}"
        for node in alternatives:
            for n in ast.walk(node):
                assert not (isinstance(n, ast.Constant) and isinstance(n.value, str)), \
                    f"{path.name}:{line}: name an alternative as Cause.X, not {n.value!r}"
                if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "Cause":
                    assert n.attr in Cause.__members__, f"{path.name}:{line}: no Cause.{n.attr}"


def test_an_engine_guard_states_causes_only_through_the_templates():
    # The integrations supply evidence; the sentence is the Cause's own template.
    calls, other = _stated_calls()
    integrations = PACKAGE / "integrations"
    assert not [p for p, _ in other if integrations in p.parents], \
        "an integration writes a Diagnosis's text itself: use Diagnosis.of(Cause.X, ...)"
    used = {(name, view) for path, _, name, views, _, _ in calls for view in views
            if integrations in path.parents}
    assert len(used) >= 25, sorted(used)       # the guards' causes all come this way
    for path, line, name, views, fields, _ in calls:
        cause = Cause[name]
        for view in views:
            assert view in cause.templates, f"{path.name}:{line}: {name} has no template {view!r}"
            wanted = {f for _, f, _, _ in string.Formatter().parse(cause.templates[view]) if f}
            assert fields == wanted, \
                f"{path.name}:{line}: {name}/{view!r} renders {sorted(wanted)}"


def test_the_audit_states_causes_only_through_the_templates():
    # The decision tree decides; the sentences are the Cause's templates. No Diagnosis in
    # kvcanary is made with a text written at the call, and no evidence field is a sentence
    # (an f-string or a literal phrase: those are templates, or a named phrase of causes).
    calls, other = _stated_calls()
    assert not other, [f"{p.relative_to(PACKAGE)}:{line}: Diagnosis(...) with its own text; "
                       "use Diagnosis.of(Cause.X, view, field=...)" for p, line in other]
    audit = {(name, view) for path, _, name, views, _, _ in calls for view in views
             if path == PACKAGE / "findings" / "diagnosis.py"}
    assert len(audit) >= 35, sorted(audit)     # every branch of the decision tree
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "of" and \
                    getattr(node.func.value, "id", None) == "Diagnosis":
                for kw in node.keywords:
                    prose = isinstance(kw.value, ast.JoinedStr) or (
                        isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)
                        and " " in kw.value.value)
                    assert not prose, f"{path.name}:{node.lineno}: {kw.arg}= is a sentence"


def test_the_static_check_sees_an_inline_text(tmp_path):
    # The check above must catch a Diagnosis built with its own text, as the tree once did.
    (tmp_path / "planted.py").write_text(
        'def f(s):\n    return Diagnosis("never-written", f"slot {s} is empty")\n')
    _, other = _stated_calls(tmp_path)
    assert [(p.name, line) for p, line in other] == [("planted.py", 2)]


def test_every_template_renders_its_fields_and_says_which_is_missing():
    for cause in Cause:
        for view, template in cause.templates.items():
            wanted = {f for _, f, _, _ in string.Formatter().parse(template) if f}
            text = cause.render(view, **{f: 1 for f in wanted})
            assert "{" not in text and text, (cause, view)
    with pytest.raises(KeyError, match="cause misread, template '': no evidence field"):
        Cause.MISREAD.render(request="r")
    with pytest.raises(KeyError, match="cause shared-slot has no template 'vllm'"):
        Cause.SHARED_SLOT.render("vllm")
    d = Diagnosis.of(Cause.REMAPPED, "history", request="r", block=3, step=9)
    assert d.cause is Cause.REMAPPED and d.text.startswith("r's block-table entry")


def test_an_audit_finding_gets_its_cause_only_from_a_diagnosis():
    from kvcanary.audit.result import Finding

    v = Violation(2, 5, 0, 0, -1, 0, 1, 1)
    with pytest.raises(ValueError, match="text of its diagnosis"):
        Finding(v, "request", cause="a cause nobody defined")
    d = diagnose(v)
    assert Finding(v, "request", cause=d.text, diagnosis=d).diagnosis.cause in Cause
