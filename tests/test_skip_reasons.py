"""Every reason a test gives for not running speaks to whoever runs the suite: what is
missing and how to get it, never the suite's own functions, variables or module paths. Read
from the test sources (every ``pytest.skip``, ``skipif``/``skip`` mark and
``importorskip``), from ``skip_reasons`` and from the reasons conftest decides here."""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest

import skip_reasons

TESTS = pathlib.Path(__file__).resolve().parent
FILE_SUFFIXES = ("md", "sh", "so", "py", "toml", "txt", "log", "html", "npz", "json")
# What a reason must not contain, each with what it catches.
INTERNAL = (
    (re.compile(r"(?<![\w/.-])_\w+"), "a private name"),
    (re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b"), "a snake_case identifier"),
    (re.compile(r"\b[A-Za-z]\w*\.(?!(?:%s)\b)[A-Za-z_]\w*" % "|".join(FILE_SUFFIXES)),
     "a dotted module or attribute path"),
    (re.compile(r"\b\w+\(\)"), "a call"),
)


def internal_names(reason: str) -> list:
    """``(text, what it is)`` for each internal name in ``reason``; pip specs in quotes
    (``'kvcanary[cuda13]'``) and CAPITAL environment variables are the user's."""
    text = re.sub(r"'[^']*'", "''", reason)
    return [(m.group(0), what) for pattern, what in INTERNAL for m in pattern.finditer(text)]


def test_the_checker_catches_internal_names():
    for bad in ("needs _no_gpu", "float4_e2m1fn_x2 missing", "kvcanary.backends.cuda failed",
                "require_cupy() raised", "see kvt.SUPPORTED_RANGE"):
        assert internal_names(bad), bad
    for good in ("no GPU: the CUDA backend needs cupy: pip install 'kvcanary[cuda13]'",
                 "KVCANARY_CUPY_PATHS is not set (.ci/run sets it; see docs/engines.md)",
                 "torch 2.13.0+cpu has no packed 4-bit float type", "needs /dev/full",
                 "cuda-core is not installed: pip install 'kvcanary[test]'"):
        assert not internal_names(good), good


def literal_text(node) -> str | None:
    """The literal parts of a string or f-string (what is known before the run), the
    reasons of ``skip_reasons`` resolved; ``""`` for what is known only at run time."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant))
    if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "skip_reasons":
        return getattr(skip_reasons, node.attr)
    if isinstance(node, ast.Call) and ast.unparse(node.func).startswith("skip_reasons."):
        return getattr(skip_reasons, node.func.attr)(*(a.value for a in node.args))
    if isinstance(node, ast.BinOp):
        parts = [literal_text(node.left), literal_text(node.right)]
        return "".join(p for p in parts if p)
    return ""


@functools.lru_cache(maxsize=None)
def reasons_in_sources() -> list:
    """``(file:line, reason or None)`` of every skip in the tests; None: no reason given
    (pytest's own then names the module that did not import)."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if not name.startswith("pytest.") or not name.endswith(("skip", "skipif",
                                                                    "importorskip")):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            where = f"{path.relative_to(TESTS)}:{node.lineno}"
            if name.endswith("importorskip"):
                found.append((where, literal_text(keywords["reason"])
                              if "reason" in keywords else None))
            elif "reason" in keywords:
                found.append((where, literal_text(keywords["reason"])))
            elif name.endswith(".skip") and node.args:
                found.append((where, literal_text(node.args[0])))
    return found


def test_every_importorskip_says_what_is_missing_and_how_to_get_it():
    missing = [where for where, reason in reasons_in_sources() if reason is None]
    assert missing == []


def test_no_skip_reason_in_the_sources_names_an_internal():
    found = reasons_in_sources()
    assert len(found) > 50
    bad = [(where, reason, internal_names(reason)) for where, reason in found
           if reason and internal_names(reason)]
    assert bad == []


def test_the_shared_and_decided_reasons_name_no_internal(pytestconfig):
    shared = [value for name, value in vars(skip_reasons).items()
              if name.isupper() and isinstance(value, str)]
    shared += [skip_reasons.transformers_extra(p) for p in ("torch", "transformers", "psutil")]
    # The suite's own conftest (beside this file), not a folder's that shares its name.
    top = TESTS / "conftest.py"
    NEEDS = next(m for m in pytestconfig.pluginmanager.get_plugins()
                 if getattr(m, "__file__", None) and pathlib.Path(m.__file__).resolve() == top).NEEDS
    decided = [NEEDS[name]() for name in ("gpu", "needs_cupy", "needs_compiler")]
    from kvcanary.backends.cuda import unavailable_reason

    decided.append(unavailable_reason())
    for reason in shared + [r for r in decided if r]:
        assert internal_names(reason) == [], reason


@pytest.mark.parametrize("reason", [skip_reasons.REPORT, skip_reasons.SAFETENSORS,
                                    skip_reasons.SERVE])
def test_a_missing_package_reason_gives_the_install_line(reason):
    assert "pip install '" in reason
