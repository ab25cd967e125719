#!/usr/bin/env python3
"""Mutation run: plant one small bug at a time in the reference, hashing, plan, audit, dump,
the CLI's exit-code logic and the CUDA kernel sources, run the tests that guard that file,
and count the mutants the tests kill.

Python mutants come from the syntax tree of the chosen functions (one change per mutant):
a comparison flipped (< and <=, > and >=, == and !=, in and not in, is and is not), an
arithmetic or bit operator swapped (+ and -, & and |, ^ to |, << and >>), and/or swapped,
a `not` or unary minus dropped. Kernel mutants flip the comparisons and && / || of the
.cu/.cuh code lines. Integer constants are not moved: that doubles the count (mostly column
indices that any test catches). The file is changed in place and restored after
each run (also on Ctrl-C); kernel builds go to a temporary harness cache.

    python scripts/mutation.py                 # every mutant (about an hour on 2 shared cores)
    python scripts/mutation.py --list          # the mutants, without running them
    python scripts/mutation.py --only kvcanary/format/hashing.py --only kernels/kvc_plan.cu
    python scripts/mutation.py --out mutants.jsonl   # one JSON record per mutant

A mutant survives when its tests pass. Survivors that cannot change behaviour are listed in
EQUIVALENT with the reason; the score counts the others.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import hypothesis  # noqa: F401  (imported once, before the forks)
import numpy  # noqa: F401
import pytest

ROOT = Path(__file__).resolve().parent.parent

# The tests that guard each file, fastest and most telling first (pytest stops at the
# first failure). The two block-edge tests at full size are left to the full suite.
SURVIVORS = "tests/test_mutation_survivors.py"  # tests written for earlier survivors
EDGES = ["tests/reference/test_block_boundaries.py", "-k", "not past_the_real"]
# out-of-range rows: the reference and the kernels side by side
OUT_OF_RANGE = "tests/kernels/cpu/test_kernels_cpu_out_of_range.py"
PLAN_TESTS = [SURVIVORS, "tests/api/test_plan_outputs_on_error.py", "tests/reference/test_reference_plan.py",
              "tests/reference/test_oracle_equivalence.py", OUT_OF_RANGE]
VERIFY_TESTS = [SURVIVORS, "tests/reference/test_reference_verify.py", "tests/api/test_extensions.py",
                "tests/reference/test_oracle_equivalence.py", OUT_OF_RANGE]
WRITE_TESTS = [SURVIVORS, "tests/reference/test_reference_write.py", "tests/api/test_extensions.py",
               "tests/reference/test_oracle_equivalence.py", OUT_OF_RANGE]
AUDIT_TESTS = [SURVIVORS, "tests/reference/test_request_boundaries.py", "tests/audit/test_audit.py"]
DUMP_TESTS = [SURVIVORS, "tests/cli/test_cli_exit_codes.py", "tests/dump/test_dump.py"]
CLI_TESTS = [SURVIVORS, "tests/cli/test_cli_exit_codes.py",
             # the interrupted record: its counts, and none in text format
             "tests/cli/test_interrupt.py::test_audit_jobs",
             "tests/cli/test_interrupt.py::test_audit_single_dump"]
KERNEL_TESTS = [SURVIVORS, "tests/reference/test_reference_verify.py",
                "tests/reference/test_reference_write.py",
                "tests/reference/test_reference_plan.py", "tests/kernels/cpu/test_kernels_cpu_out_of_range.py",
                "tests/kernels/cpu/test_kernels_cpu_coverage.py", "tests/kernels/cpu/test_kernels_cpu_plan.py",
                # the source-count bound's static_assert at both ends of [1, 64]
                "tests/kernels/nvrtc/test_kernels_nvrtc.py::test_variant_compiles[verify-False-1-sm_80]",
                "tests/kernels/nvrtc/test_kernels_nvrtc.py::test_variant_compiles[verify-False-64-sm_80]",
                "tests/kernels/nvrtc/test_kernels_nvrtc.py::test_bound_out_of_range_fails_with_static_assert",
                ]


@dataclass(frozen=True)
class Target:
    path: str
    functions: tuple | None  # None: every function of the file
    tests: list


TARGETS = [
    Target("kvcanary/format/hashing.py", None, [SURVIVORS, "tests/format/test_hash_pins.py", *EDGES]),
    Target("kvcanary/backends/reference/plan.py", None, PLAN_TESTS),
    Target("kvcanary/backends/reference/verify.py", None, VERIFY_TESTS),
    Target("kvcanary/backends/reference/write.py", None, WRITE_TESTS),
    Target("kvcanary/backends/reference/realkv.py", None, [SURVIVORS, "tests/reference/test_realkv.py",
                                                         "tests/reference/test_realkv_compiled.py", *EDGES]),
    Target("kvcanary/audit/launches.py", ("_plan_groups", "slot_zero_rows"), AUDIT_TESTS),
    Target("kvcanary/audit/matching.py", ("attribute_rows", "_occurrence", "_match_rows"), AUDIT_TESTS),
    Target("kvcanary/findings/diagnosis.py", ("failed_checks",), AUDIT_TESTS),
    Target("kvcanary/dump/check.py", ("_load_swa", "_load_expected", "_load_sweep", "nonnegative"),
           DUMP_TESTS),
    Target("kvcanary/cli/audit.py", ("audit_command",), CLI_TESTS),
    Target("kvcanary/cli/common.py", ("fail", "error_boundary"), CLI_TESTS),
    Target("kernels/kvc_common.cuh", None, KERNEL_TESTS),
    Target("kernels/kvc_realkv.cuh", None, KERNEL_TESTS),
    Target("kernels/kvc_plan.cu", None, KERNEL_TESTS),
    Target("kernels/kvc_verify.cu", None, KERNEL_TESTS),
    Target("kernels/kvc_write.cu", None, KERNEL_TESTS),
]

# Survivors that cannot change what any caller observes, by mutant id, with the reason.
# The ids name lines: a test (tests/test_mutation_script.py) keeps them pointing at
# mutants that exist.
EQUIVALENT: dict[str, str] = {
    "kernels/kvc_realkv.cuh:43:36:< -> <=":
        "min(num_sources, kMaxSources): both branches give the same value when they are equal",
    "kernels/kvc_realkv.cuh:95:36:< -> <=":
        "min(num_sources, kMaxSources): both branches give the same value when they are equal",
    "kernels/kvc_plan.cu:39:34:>= -> >":
        "row 0 is never looked up: the padding row has no entries and no seed",
    "kvcanary/backends/reference/plan.py:48:15:rows >= 0 -> rows > 0":
        "row 0 is never looked up: the padding row has no entries and no seed",
    "kvcanary/backends/reference/plan.py:161:16:table_row >= 0 -> table_row > 0":
        "row 0 is never looked up: the padding row has no entries",
    "kernels/kvc_plan.cu:91:8:> -> >=":
        "clamping a length equal to capacity + 1 to capacity + 1 changes nothing",
    "kernels/kvc_plan.cu:110:38:< -> <=":
        "an extra thread t == work writes nothing: t > write_req_capacity and t >= bs",
    "kernels/kvc_plan.cu:119:44:> -> >=":
        "an extend of 0 gives a write length of 0 on either branch",
    "kernels/kvc_verify.cu:107:13:<= -> <":
        "with no active entry the loop runs no iteration and the counter adds 0",
    "kvcanary/backends/reference/verify.py:87:16:slot < 0 -> slot <= 0":
        "slot 0 is skipped after the range rule: its bits are cleared and it is never hashed",
    "kvcanary/backends/reference/write.py:70:7:active <= 0 -> active < 0":
        "with no active request every array below is empty: nothing is written",
    "kvcanary/backends/reference/write.py:82:22:-1 -> 1":
        "the entry key orders rows within one request, and a request outside the token "
        "arrays has just this one row",
    "kvcanary/backends/reference/realkv.py:91:7:mode == RealKvHashMode.NONE or not sources -> "
    "mode == RealKvHashMode.NONE and (not sources)":
        "mode NONE folds zero bytes per source (splitmix64(0) is 0) and no source folds "
        "nothing: the result is 0 either way",
    "kvcanary/audit/matching.py:22:36:-1 -> 1":
        "the array is returned as is only for zero rows (empty) or rows naming no planned "
        "slot, which verify cannot produce",
    "kvcanary/audit/matching.py:73:18:np.arange(order.size) - np.searchsorted(sorted_groups, "
    "sorted_groups, 'left') -> np.arange(order.size) + np.searchsorted(sorted_groups, "
    "sorted_groups, 'left')":
        "ring rows and host predictions are the same multiset, so every group starts at the "
        "same index in both and the shifted ranks still pair the k-th copies",
    "kvcanary/audit/matching.py:101:11:max(n, predicted.shape[0]) + 1 -> max(n, predicted.shape[0]) - 1":
        "the span stays above every occurrence index unless one group holds every row, and "
        "then there is no other group to collide with",
    "kvcanary/backends/reference/write.py:55:48:-1 -> 1":
        "stacking 1-D keys: axis 1 is the last axis",
    "kernels/kvc_write.cu:51:13:> -> >=":
        "clamping an active count equal to the capacity to the capacity changes nothing",
    "kernels/kvc_plan.cu:142:9:<= -> <":
        "with bs == 0 the total is 0, so the next line returns as well (and the launcher "
        "skips this launch for an empty batch)",
}


@dataclass
class Mutant:
    id: str          # path:line:column:what, stable while the line does not move
    path: str
    line: int
    text: str        # the mutated file
    tests: list


# --------------------------------------------------------------------------- Python

COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                 ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
                 ast.Is: ast.IsNot, ast.IsNot: ast.Is}
BINOP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
               ast.BitXor: ast.BitOr, ast.LShift: ast.RShift, ast.RShift: ast.LShift}
BOOL_SWAPS = {ast.And: ast.Or, ast.Or: ast.And}


def _skipped(node, parents) -> bool:
    """Error messages and docstrings: their text is not behaviour the tests pin here."""
    return any(isinstance(p, (ast.JoinedStr, ast.Raise)) for p in parents)


def _sites(function):
    """(node, parents, change) for every one-change mutant inside ``function``."""
    stack = [(function, [])]
    while stack:
        node, parents = stack.pop()
        for child in ast.iter_child_nodes(node):
            stack.append((child, parents + [node]))
        if _skipped(node, parents):
            continue
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in COMPARE_SWAPS:
                    yield node, ("compare", i, COMPARE_SWAPS[type(op)])
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in BINOP_SWAPS:
            yield node, ("binop", BINOP_SWAPS[type(node.op)])
        elif isinstance(node, ast.BoolOp):
            yield node, ("boolop", BOOL_SWAPS[type(node.op)])
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            yield node, ("drop-unary",)


def _apply(node, change):
    kind = change[0]
    if kind == "compare":
        node.ops[change[1]] = change[2]()
    elif kind in ("binop", "boolop"):
        node.op = change[1]()
    return node


def _replace(tree, target, replacement):
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, field, replacement)
                return
            if isinstance(value, list) and any(v is target for v in value):
                value[[id(v) for v in value].index(id(target))] = replacement
                return


def python_mutants(target: Target) -> list[Mutant]:
    source = (ROOT / target.path).read_text()
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and (target.functions is None or n.name in target.functions)]
    mutants = []
    for function in functions:
        first = min([function.lineno] + [d.lineno for d in function.decorator_list])
        indent = " " * function.col_offset
        for node, change in list(_sites(function)):
            twin = copy.deepcopy(function)
            twin_node = next(n for n, o in zip(ast.walk(twin), ast.walk(function)) if o is node)
            before = ast.unparse(node)
            if change[0] == "drop-unary":
                _replace(twin, twin_node, twin_node.operand)
                after = ast.unparse(twin_node.operand)
            else:
                after = ast.unparse(_apply(twin_node, change))
            body = "".join(indent + line if line.strip() else line
                           for line in (ast.unparse(twin) + "\n").splitlines(keepends=True))
            text = "".join(lines[:first - 1]) + body + "".join(lines[function.end_lineno:])
            ident = f"{target.path}:{node.lineno}:{node.col_offset}:{before} -> {after}"
            mutants.append(Mutant(ident, target.path, node.lineno, text, target.tests))
    return mutants


# --------------------------------------------------------------------------- CUDA C

KERNEL_SWAPS = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==",
                "&&": "||", "||": "&&"}
KERNEL_OPERATOR = re.compile(r"(?<= )(<=|>=|==|!=|&&|\|\||<|>)(?= )")


def kernel_mutants(target: Target) -> list[Mutant]:
    lines = (ROOT / target.path).read_text().splitlines(keepends=True)
    mutants = []
    for number, line in enumerate(lines, start=1):
        code = line.split("//", 1)[0]
        if code.lstrip().startswith("#"):
            continue
        for match in KERNEL_OPERATOR.finditer(code):
            op = match.group(1)
            mutated = line[:match.start()] + KERNEL_SWAPS[op] + line[match.end():]
            text = "".join(lines[:number - 1]) + mutated + "".join(lines[number:])
            ident = f"{target.path}:{number}:{match.start()}:{op} -> {KERNEL_SWAPS[op]}"
            mutants.append(Mutant(ident, target.path, number, text, target.tests))
    return mutants


def all_mutants(only: list[str]) -> list[Mutant]:
    mutants = []
    for target in TARGETS:
        if only and target.path not in only:
            continue
        make = kernel_mutants if target.path.startswith("kernels/") else python_mutants
        mutants += make(target)
    return mutants


# --------------------------------------------------------------------------- running

def _pytest_in_child(tests: list, cache: str) -> int:
    """Run pytest in a forked child of this process, which has already imported numpy,
    hypothesis and pytest (kvcanary itself is imported fresh, mutant included): this saves
    most of a cold start per mutant. Returns pytest's exit status."""
    pid = os.fork()
    if pid == 0:
        status = 3
        try:
            os.environ["KVCANARY_HARNESS_CACHE"] = cache
            sys.dont_write_bytecode = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            status = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests])
        finally:
            os._exit(int(status))
    return pid


def run_mutant(mutant: Mutant, cache: str, timeout: int) -> tuple[str, float]:
    """'killed' or 'survived' (a timeout or a crash counts as killed), and the seconds."""
    path = ROOT / mutant.path
    original = path.read_text()
    started = time.monotonic()
    pid = None
    try:
        path.write_text(mutant.text)
        pid = _pytest_in_child(mutant.tests, cache)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                pid = None
                break
            if time.monotonic() - started > timeout:
                break
            time.sleep(0.05)
        outcome = "survived" if pid is None and os.waitstatus_to_exitcode(status) == 0 \
            else "killed"
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        path.write_text(original)
    return outcome, time.monotonic() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], metavar="PATH",
                        help="mutate only this file (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--out", type=Path, default=None, help="JSON Lines record per mutant")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per mutant")
    parser.add_argument("--every", type=int, default=1, metavar="K",
                        help="run every K-th mutant only (a fixed, reproducible sample)")
    parser.add_argument("--start", type=int, default=1, metavar="N",
                        help="resume an interrupted run at mutant N of the list")
    parser.add_argument("--ids", type=Path, default=None, metavar="FILE",
                        help="run only the mutants whose ids are listed in FILE, one a line "
                             "(e.g. the survivors of a previous run)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only or ()) - {target.path for target in TARGETS})
    if unknown:     # a path the layout no longer has would select nothing, silently
        parser.error(f"--only {unknown[0]}: not a mutated file (they are: "
                     f"{', '.join(target.path for target in TARGETS)})")
    mutants = all_mutants(args.only)[::max(1, args.every)][args.start - 1:]
    if args.ids:
        wanted = set(args.ids.read_text().splitlines())
        mutants = [m for m in mutants if m.id in wanted]
    if args.list:
        for mutant in mutants:
            print(mutant.id)
        print(f"{len(mutants)} mutants")
        return 0
    survivors, equivalent, killed = [], [], 0
    out = args.out.open("w") if args.out else None
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory(prefix="kvcanary-mutation-") as cache:
        for index, mutant in enumerate(mutants, start=1):
            outcome, seconds = run_mutant(mutant, cache, args.timeout)
            if outcome == "killed":
                killed += 1
            elif mutant.id in EQUIVALENT:
                equivalent.append(mutant)
            else:
                survivors.append(mutant)
            print(f"[{index}/{len(mutants)}] {outcome:8} {seconds:5.1f}s {mutant.id}", flush=True)
            if out:
                out.write(json.dumps({"id": mutant.id, "outcome": outcome,
                                      "equivalent": EQUIVALENT.get(mutant.id),
                                      "seconds": round(seconds, 2)}) + "\n")
                out.flush()
    scored = len(mutants) - len(equivalent)
    print(f"\n{len(mutants)} mutants: {killed} killed, {len(equivalent)} equivalent, "
          f"{len(survivors)} survived; score {killed}/{scored} = "
          f"{100.0 * killed / scored if scored else 100.0:.1f}%")
    for mutant in equivalent:
        print(f"equivalent: {mutant.id}: {EQUIVALENT[mutant.id]}")
    for mutant in survivors:
        print(f"SURVIVED: {mutant.id}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
