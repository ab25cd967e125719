"""kernels/kvc_consts.cuh and kvcanary/format/consts.py hold the same constants (docs/format.md §1)."""

import enum
import pathlib
import re

import pytest

from kvcanary.format import consts

CUH = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "kvc_consts.cuh"

_CONSTEXPR = re.compile(r"constexpr\s+[\w:]+\s+k(\w+)\s*=\s*([^;]+);")
_ENUM = re.compile(r"enum\s+class\s+(\w+)\s*:\s*[\w:]+\s*\{([^}]*)\}", re.S)
_MEMBER = re.compile(r"k(\w+)\s*=\s*([^,]+)")


def upper_snake(camel: str) -> str:
    """``CanaryChainAnchor`` -> ``CANARY_CHAIN_ANCHOR``; ``Splitmix64Mul1`` -> ``SPLITMIX64_MUL_1``."""
    words = re.findall(r"[A-Z][a-z]*\d*|\d+", camel)
    out = []
    for word in words:
        head = re.match(r"([A-Za-z]+)(\d*)$", word)
        if head and head.group(2) and head.group(1) not in ("Splitmix",):
            out += [head.group(1), head.group(2)]
        else:
            out.append(word)
    return "_".join(w.upper() for w in out)


def c_value(expr: str) -> int:
    expr = re.sub(r"(?<=[0-9A-Fa-f])(ULL|LL|UL|U|L)\b", "", expr.strip())
    if not re.fullmatch(r"[0-9A-Fa-fxX<>()\s|+\-*]+", expr):
        raise AssertionError(f"unparsed C++ expression {expr!r}")
    return int(eval(expr, {"__builtins__": {}}))  # digits and operators only


def cuh_constants() -> dict:
    text = re.sub(r"//[^\n]*", "", CUH.read_text())
    return {upper_snake(n): c_value(v) for n, v in _CONSTEXPR.findall(text)}


def cuh_enums() -> dict:
    text = re.sub(r"//[^\n]*", "", CUH.read_text())
    return {name: {upper_snake(m): c_value(v) for m, v in _MEMBER.findall(body)}
            for name, body in _ENUM.findall(text)}


def python_constants() -> dict:
    return {name: value for name, value in vars(consts).items()
            if name.isupper() and not name.startswith("_") and type(value) is int}


def test_upper_snake():
    assert upper_snake("CanaryChainAnchor") == "CANARY_CHAIN_ANCHOR"
    assert upper_snake("Splitmix64Mul1") == "SPLITMIX64_MUL_1"
    assert upper_snake("RealKvSourceFieldNumBytesPerToken") == \
        "REAL_KV_SOURCE_FIELD_NUM_BYTES_PER_TOKEN"
    assert upper_snake("HeadKFull") == "HEAD_K_FULL"


def test_parser_finds_the_constants():
    found = cuh_constants()
    assert found["CANARY_CHAIN_ANCHOR"] == 0xC0FFEE1234567890
    assert found["PLAN_SLOT_OUT_OF_TABLE"] == (1 << 63) - 1
    assert len(found) >= 30


def test_every_cuh_constant_is_in_python_with_the_same_value():
    py = python_constants()
    for name, value in cuh_constants().items():
        assert name in py, f"{name} is in kvc_consts.cuh but not in kvcanary/format/consts.py"
        assert py[name] == value, name


def test_every_python_int_constant_is_in_the_cuh():
    cuh = cuh_constants()
    for name, value in python_constants().items():
        assert name in cuh, f"{name} is in kvcanary/format/consts.py but not in kvc_consts.cuh"
        assert cuh[name] == value, name


@pytest.mark.parametrize("name, py_enum", [
    ("FailReason", consts.FailReason),
    ("RealKvHashMode", consts.RealKvHashMode),
    ("LaunchTag", consts.LaunchTag),
])
def test_enums_match_both_ways(name, py_enum):
    cuh = cuh_enums()
    assert name in cuh
    members = {m.name: int(m.value) for m in py_enum}
    assert cuh[name] == members


def test_upstream_enum_values():
    F = consts.FailReason
    assert issubclass(F, enum.IntFlag)
    assert [int(F.VERIFY_CHAIN_HASH_MISMATCH), int(F.VERIFY_POSITION_MISMATCH),
            int(F.VERIFY_REAL_KV_HASH_MISMATCH), int(F.WRITE_TOKEN_MISMATCH),
            int(F.WRITE_POSITION_MISMATCH), int(F.VERIFY_TOKEN_MISMATCH)] == [1, 2, 4, 8, 16, 32]
    assert [int(F.SLOT_OUT_OF_RANGE), int(F.SLOT_ZERO_IN_PREFIX),
            int(F.WRITE_SLOT_CONFLICT)] == [64, 128, 256]
    assert {m.name: int(m) for m in consts.RealKvHashMode} == {"NONE": 0, "PARTIAL": 1, "ALL": 2}
    assert [m.name for m in sorted(consts.LaunchTag)] == [
        "HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL", "SWEEP_K_FULL",
        "SWEEP_V_FULL", "HEAD_K_SWA", "HEAD_V_SWA", "TAIL_K_SWA", "TAIL_V_SWA", "SWEEP_K_SWA",
        "SWEEP_V_SWA"]
    assert consts.MAX_REAL_KV_SOURCES == 4 and consts.CANARY_SLOT_BYTES == 32
