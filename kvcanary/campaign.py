"""The coverage campaign behind ``kvcanary campaign``: measure, over many randomized synth
workloads, that the audit detects every injected fault it is designed to see and reports
nothing on clean workloads.

One *fault run* samples a small workload (page size 1, 16 or 64; SWA on or off; 0 to 4
real-KV sources; the hash mode of the run), plays it with :class:`~kvcanary.synth.Synthesis`,
audits the clean final state, then runs one *injection* per fault kind still short of its
target: a copy of the final state gets faults of that kind at every target class still short
(request heads, last tokens, window heads, chunk boundaries, shared and cached prefix blocks,
the interior), is audited on every backend and under both rule sets (kvcanary's, and
``--compat``: upstream's only), and each fault is scored with :func:`kvcanary.synth.score` at
its sites: every verify entry it changed, with the request row, position and slot the audit
must name. Faults of one injection never interact: synth keeps every target's slot apart
from the others and from their chain neighbours (a content fault breaks its successor's chain
link). A fault with findings at its sites although the canary is not designed to see it would
reveal such crosstalk; the campaign counts these and fails on any.

Rounds of runs are planned from the remaining deficits until every (class, kind, mode) cell
holds at least ``faults_per_kind`` faults; ``real-kv-byte`` in partial mode is split at the 16
bytes partial mode hashes, and each half must reach the target. *Clean runs* are further
randomized workloads, every one with a sliding window, shared prefix-cache blocks in a live
request's window and a chunk boundary (a sampled workload without them is replaced), audited
without faults; every violation there, in the clean state of a fault run before its
injections, or in a simulation's own in-run verify, is a false positive.

Every run is a function of the campaign seed and its index, independent of ``jobs``; a miss
is reported with the ``kvcanary synth`` / ``kvcanary audit`` commands that reproduce it.
"""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import platform
import shlex
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from . import dump as dumpio
from .audit import AuditError, audit, resolve_backend
from .consts import REAL_KV_PARTIAL_READ_BYTES
from .interrupt import WorkerPool
from .synth import (FAULT_KINDS, MODES, TARGET_CLASSES, SynthConfig, SynthError, Synthesis,
                    faults_from_dump, score)
from .synth.faults import PAIR_KINDS, PAIR_SHAPES, PAIRS_NOT_UNION
from .violations import reason_labels

RULES = ("kvcanary", "compat")
RULE_WORDS = {"kvcanary": "kvcanary rules (default audit)",
              "compat": "--compat (upstream's rules only)"}
PAGE_SIZES = (1, 16, 64)
BYTES_PER_TOKEN = (16, 32, 64)
LOW, HIGH = f"byte < {REAL_KV_PARTIAL_READ_BYTES}", f"byte >= {REAL_KV_PARTIAL_READ_BYTES}"


# Faults of one kind per class in one injection: every entry of the scarce classes (a few per
# run), a few of the plentiful ones.
PER_INJECTION = {"head": 64, "window-head": 64, "last": 64, "chunk-boundary": 64, "shared": 32,
                 "cached": 8, "interior": 8}
# Expected faults of one kind per class and run (measured over sampled workloads), to size a
# round; the next round fixes any shortfall.
CLASS_YIELD = {"head": 6.0, "window-head": 6.0, "last": 15.0, "chunk-boundary": 26.0,
               "shared": 16.0, "cached": 8.0, "interior": 8.0}
# Classes in the order an injection fills them: the scarce ones first.
FILL_ORDER = ("head", "window-head", "last", "chunk-boundary", "shared", "cached", "interior")
# Every fault run ends with one injection of interacting pairs: this many kind pairs per
# shape, this many pairs of each.
PAIR_COMBOS_PER_RUN, PAIRS_PER_COMBO = 2, 4
PAIR_COMBOS = [(a, b) for a in PAIR_KINDS for b in PAIR_KINDS if (a, b) not in PAIRS_NOT_UNION]
CLEAN_RUN_CLASSES = ("shared", "window-head", "chunk-boundary")
CLEAN_RUN_ATTEMPTS = 20


def injections(kind: str, mode: str) -> int:
    """Injections of a kind per run. The k-th real-kv-byte fault of an injection lands in
    16-byte window k of the slot (modulo its size); partial mode, whose table splits at 16
    bytes, gets two injections (classes filled in reverse order in the second)."""
    return 2 if (kind, mode) == ("real-kv-byte", "partial") else 1


MAX_ROUNDS = 200
DEFAULT_FAULTS_PER_KIND = 1000
DEFAULT_CLEAN_RUNS = 200
MAX_REPORTED = 25   # misses and false positives kept in full


LAYOUTS = ("per-token", "paged")


class CampaignError(ValueError):
    """A bad campaign option (the message names it) or an unusable backend."""


# --------------------------------------------------------------------------- cells


def scopes(kind: str, mode: str) -> tuple:
    """The table rows one (kind, mode) splits into."""
    return (LOW, HIGH) if (kind, mode) == ("real-kv-byte", "partial") else ("",)


def fault_scope(kind: str, mode: str, detail: int) -> str:
    if (kind, mode) == ("real-kv-byte", "partial"):
        return LOW if detail < REAL_KV_PARTIAL_READ_BYTES else HIGH
    return ""


def designed(kind: str, mode: str, scope: str, rules: str, target: str = "interior"):
    """``(True, "")`` where the canary is designed to see the fault, else ``(False, why)``."""
    if target == "window-head" and kind == "prev-hash":
        return False, ("the predecessor's SWA slot is already freed, so verify cannot read "
                       "it and the chain check at a window head is vacuous by design")
    if target == "cached" and kind == "token":
        return False, ("sweep entries carry no expected token (the prefix cache keeps no "
                       "token pool); a changed token shows only as its successor's broken "
                       "chain link")
    if target == "cached" and kind == "slot-zero":
        return False, ("verify skips slot 0 as unfilled, and SLOT_ZERO_IN_PREFIX checks live "
                       "requests' tables only, not the prefix cache's blocks")
    if kind == "real-kv-byte" and mode == "none":
        return False, ("mode none does not hash real KV: the record's real-KV field is 0 and "
                       "the bytes are never read")
    if kind == "real-kv-byte" and scope == HIGH:
        return False, (f"partial mode hashes only the first {REAL_KV_PARTIAL_READ_BYTES} bytes "
                       "of each slot's real KV per source")
    if kind == "slot-zero" and rules == "compat":
        return False, ("upstream's verify skips slot 0 as an unfilled slot; only kvcanary's "
                       "SLOT_ZERO_IN_PREFIX audit extension sees it, and --compat turns it off")
    return True, ""


def all_cells():
    return [(target, kind, mode, scope) for target in TARGET_CLASSES for kind in FAULT_KINDS
            for mode in MODES for scope in scopes(kind, mode)]


@dataclass
class Cell:
    injected: int = 0
    visible: int = 0            # faults the canary is designed to see (ground truth)
    detected: int = 0           # visible faults whose expected bits fired at the target
    stray: int = 0              # invisible faults with a finding at a site (crosstalk)
    sites: int = 0              # sites that had to fire, over the visible faults
    multi_row: int = 0          # visible faults whose sites span two or more request rows
    fired: Counter = field(default_factory=Counter)   # label -> faults where it fired

    def add(self, other: "Cell") -> None:
        self.injected += other.injected
        self.visible += other.visible
        self.detected += other.detected
        self.stray += other.stray
        self.sites += other.sites
        self.multi_row += other.multi_row
        self.fired.update(other.fired)

    def to_dict(self) -> dict:
        return {"injected": self.injected, "visible": self.visible, "detected": self.detected,
                "stray": self.stray, "sites": self.sites, "multi_row": self.multi_row,
                "fired": dict(sorted(self.fired.items()))}


# --------------------------------------------------------------------------- workloads


def sample_config(rng: np.random.Generator, mode: str, *, clean: bool = False) -> dict:
    """A small randomized workload whose every field is a ``kvcanary synth`` option; a clean
    run always has a sliding window (fault runs' clean states cover runs without)."""
    swa = int(rng.integers(24, 65)) if clean or rng.random() < 0.5 else 0
    return dict(
        requests=int(rng.integers(48, 97)),
        num_slots=8192,
        max_running=int(rng.integers(16, 33)),
        page_size=int(rng.choice(PAGE_SIZES)),
        swa_window=swa,
        sources=int(rng.integers(0, 5)),
        bytes_per_token=int(rng.choice(BYTES_PER_TOKEN)),
        mode=mode,
        chunk_size=int(rng.choice((7, 16, 32, 64))),
        prompt_len=(8, 48),
        output_len=(4, 16),
        verify_every=int(rng.choice((1, 4, 8) if clean else (4, 8))),
        seed=int(rng.integers(0, 2 ** 31 - 1)),
    )


def synth_command(config: dict, inject=()) -> str:
    """The ``kvcanary synth`` command that rebuilds a run's dump (and its faults)."""
    c = config
    args = ["kvcanary", "synth", "repro.npz", "--requests", c["requests"],
            "--slots", c["num_slots"], "--max-running", c["max_running"],
            "--page-size", c["page_size"], "--swa-window", c["swa_window"],
            "--sources", c["sources"], "--bytes-per-token", c["bytes_per_token"],
            "--mode", c["mode"], "--chunk-size", c["chunk_size"],
            "--prompt-len", "{}..{}".format(*c["prompt_len"]),
            "--output-len", "{}..{}".format(*c["output_len"]),
            "--verify-every", c["verify_every"], "--seed", c["seed"]]
    for kind, count, target in inject:
        args += ["--inject", f"{kind}:{count}@{target}"]
    return " ".join(shlex.quote(str(a)) for a in args)


def audit_command(backend: str, rules: str) -> str:
    return f"kvcanary audit repro.npz --backend {backend}" + (" --compat" if rules == "compat" else "")


def _dump(arrays: dict):
    """The synthesis arrays as a validated in-memory dump (what ``load`` gives after ``save``)."""
    values = {dumpio.VERSION_KEY: np.array(dumpio.DUMP_VERSION, dtype=np.int64)}
    for key, value in arrays.items():
        if value is not None:
            values[key] = dumpio._host_array(value, key)
    return dumpio.validate("<campaign>", "memory", values)


def _synthesis(config: dict) -> Synthesis:
    return Synthesis(SynthConfig(**config)).run()


def _audits(d, backends):
    for backend in backends:
        for rules in RULES:
            yield backend, rules, audit(d, backend=backend, compat=rules == "compat",
                                         max_findings=0)


def _false_positive(where: str, config: dict, backend: str, rules: str, result) -> dict:
    first = result.findings[0] if result.findings else None
    return {"where": where, "backend": backend, "rules": rules,
            "violations": result.total_violations,
            "first": first.violation.log_line() if first else "",
            "at": first.where() if first else "", "config": config,
            "reproduce": synth_command(config) + " && " + audit_command(backend, rules)}


def _audit_clean(out: dict, config, synthesis, backends, phase: str, what: str) -> None:
    """Audit ``synthesis``'s (fault-free) state on every backend and rule set, counting
    audits and any violation as a false positive under ``phase``."""
    for backend, rules, result in _audits(_dump(synthesis.arrays()), backends):
        key = _fp_key(phase, backend, rules)
        audits, violations = out["fp"].get(key, (0, 0))
        out["fp"][key] = (audits + 1, violations + result.total_violations)
        if result.total_violations:
            out["false_positives"].append(
                _false_positive(what, config, backend, rules, result))


def _simulate(out: dict, config):
    """Play ``config``; None when it failed (recorded as an error: an honest run whose in-run
    verify fired)."""
    try:
        return _synthesis(config)
    except SynthError as exc:
        out["errors"].append({"what": f"simulation failed: {str(exc).splitlines()[0]}",
                              "config": config, "reproduce": synth_command(config)})
        return None


def target_census(synthesis) -> dict:
    """Target class -> verify entries of that class in a synthesis's state."""
    masks = synthesis.injector.entries().masks
    return {target: int(masks[target].sum()) for target in TARGET_CLASSES}


def _fp_key(where: str, backend: str, rules: str) -> str:
    return "|".join((where, backend, rules))


def run_fault_task(task: dict) -> dict:
    """One fault run (see the module docstring); runs in a worker process too."""
    config, backends = task["config"], task["backends"]
    out = {"index": task["index"], "cells": {}, "misses": [], "false_positives": [],
           "errors": [], "fp": {}, "unattributed": 0, "injections": [], "targets": []}
    clean = _simulate(out, config)
    if clean is None:
        return out
    _audit_clean(out, config, clean, backends, "prefault", "clean state of a fault run")
    for injection in task["plan"]:
        synthesis = copy.deepcopy(clean)
        done = []
        for kind, want, target in injection:
            made = synthesis.inject_up_to(kind, want, target)
            if made:
                done.append((kind, len(made) // (2 if target in PAIR_SHAPES else 1), target))
        if done:
            out["injections"].append(done)
            _score_injection(out, config, backends, synthesis, done)
    return out


def _score_injection(out: dict, config, backends, synthesis, done) -> None:
    """Audit one injection's faulty state and score every fault into the run's cells."""
    d = _dump(synthesis.arrays())
    faults = faults_from_dump(d)
    out["targets"].append([(f.kind, f.target, f.request_row, f.position, f.slot)
                           for f in faults])
    mode = config["mode"]
    for backend, rules, result in _audits(d, backends):
        out["unattributed"] += result.unattributed
        for fault, outcome in zip(faults, score(faults, result)):
            scope = fault_scope(fault.kind, mode, fault.detail)
            key = "|".join((backend, rules, fault.target, fault.kind, mode, scope))
            cell = out["cells"].setdefault(key, Cell())
            cell.injected += 1
            should, _ = designed(fault.kind, mode, scope, rules, fault.target)
            if outcome.visible != should:
                out["errors"].append({
                    "what": f"{fault.kind} fault at a {fault.target} entry: synth's ground "
                            f"truth says visible={outcome.visible}, the campaign's table says "
                            f"{should}",
                    "config": config, "reproduce": synth_command(config, done)})
            labels = reason_labels(outcome.fired_bits)
            if should:
                cell.visible += 1
                cell.sites += outcome.sites
                cell.multi_row += outcome.request_rows >= 2
                cell.fired.update(labels)
                if outcome.detected:
                    cell.detected += 1
                else:
                    out["misses"].append({
                        "backend": backend, "rules": rules, "target": fault.target,
                        "kind": fault.kind, "mode": mode, "scope": scope,
                        "request_row": fault.request_row, "position": fault.position,
                        "slot": fault.slot, "detail": fault.detail,
                        "sites": [(site.entry, site.request_row, site.position, site.slot)
                                  for site in fault.sites],
                        "expected": reason_labels(outcome.expected_bits), "fired": labels,
                        "note": outcome.note, "config": config, "inject": done,
                        "reproduce": synth_command(config, done) + " && "
                                     + audit_command(backend, rules)})
            elif outcome.fired_bits:
                cell.stray += 1
                cell.fired.update(labels)


def clean_run_config(seed: int, index: int, attempt: int) -> dict:
    rng = np.random.default_rng([seed, 1, index, attempt])
    return sample_config(rng, MODES[int(rng.integers(len(MODES)))], clean=True)


def run_clean_task(task: dict) -> dict:
    """One clean run: the first sampled workload whose final state holds every class of
    ``CLEAN_RUN_CLASSES`` (or the last attempt, flagged), audited without faults."""
    out = {"index": task["index"], "fp": {}, "false_positives": [], "errors": [],
           "replaced": 0, "census": {}, "missing": []}
    for attempt in range(CLEAN_RUN_ATTEMPTS):
        config = clean_run_config(task["seed"], task["index"], attempt)
        synthesis = _simulate(out, config)
        if synthesis is None:
            return out
        census = target_census(synthesis)
        missing = [t for t in CLEAN_RUN_CLASSES if not census[t]]
        if not missing or attempt == CLEAN_RUN_ATTEMPTS - 1:
            break
        out["replaced"] += 1
    out["census"], out["missing"] = census, missing
    _audit_clean(out, config, synthesis, task["backends"], "clean", "clean run")
    return out


# --------------------------------------------------------------------------- the campaign


@dataclass
class CampaignReport:
    faults_per_kind: int
    clean_runs: int
    seed: int
    backends: list
    skipped_backends: dict
    jobs: int
    # (backend, rules, target class, kind, mode, scope) -> Cell
    cells: dict = field(default_factory=dict)
    fault_runs: int = 0
    injections: int = 0
    rounds: int = 0
    unattributed: int = 0
    clean_replaced: int = 0                          # clean workloads resampled (a class absent)
    clean_missing: list = field(default_factory=list)   # clean runs still lacking a class
    clean_census: Counter = field(default_factory=Counter)  # class -> entries over clean runs
    clean_census_min: dict = field(default_factory=dict)    # class -> fewest in one clean run
    mix: Counter = field(default_factory=Counter)    # (setting, value) -> fault runs
    misses: list = field(default_factory=list)
    miss_count: int = 0
    # ("clean" | "prefault", backend, rules) -> [audits, violations]: clean runs, and fault
    # runs before their injection
    fp: dict = field(default_factory=dict)
    false_positives: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    elapsed_s: float = 0.0
    machine: str = ""

    def cell(self, backend, rules, target, kind, mode, scope="") -> Cell:
        return self.cells.get((backend, rules, target, kind, mode, scope), Cell())

    def _fp_total(self, where: str, index: int) -> int:
        return sum(v[index] for k, v in self.fp.items() if k[0] == where)

    @property
    def clean_audits(self) -> int:
        return self._fp_total("clean", 0)

    @property
    def clean_violations(self) -> int:
        return self._fp_total("clean", 1)

    @property
    def prefault_audits(self) -> int:
        return self._fp_total("prefault", 0)

    @property
    def prefault_violations(self) -> int:
        return self._fp_total("prefault", 1)

    def add_fp(self, counts: dict) -> None:
        for key, (audits, violations) in counts.items():
            entry = self.fp.setdefault(tuple(key.split("|")), [0, 0])
            entry[0] += audits
            entry[1] += violations

    @property
    def false_positive_count(self) -> int:
        return self.clean_violations + self.prefault_violations + sum(
            1 for e in self.errors if e["what"].startswith("simulation failed"))

    @property
    def stray(self) -> int:
        return sum(c.stray for c in self.cells.values())

    def failures(self) -> list:
        """The targets missed, one sentence each (empty: every target met)."""
        problems = []
        for (backend, rules, target, kind, mode, scope), c in sorted(self.cells.items()):
            label = (f"{kind}{' (' + scope + ')' if scope else ''} at {target} entries in mode "
                     f"{mode}, {backend}, {rules}")
            if c.detected < c.visible:
                problems.append(f"{label}: {c.visible - c.detected} of {c.visible} faults the "
                                "canary is designed to see were missed")
            if c.stray:
                problems.append(f"{label}: {c.stray} faults the canary is not designed to see "
                                "had findings at their target (faults interacting?)")
        for target, kind, mode, scope in all_cells():
            injected = self.cell(self.backends[0], RULES[0], target, kind, mode, scope).injected
            if injected < self.faults_per_kind:
                problems.append(f"{kind}{' (' + scope + ')' if scope else ''} at {target} "
                                f"entries in mode {mode}: only {injected} faults injected, "
                                f"target {self.faults_per_kind}")
        for index, missing in self.clean_missing[:MAX_REPORTED]:
            problems.append(f"clean run {index} has no {', '.join(missing)} entries after "
                            f"{CLEAN_RUN_ATTEMPTS} sampled workloads")
        if self.clean_violations:
            problems.append(f"{self.clean_violations} violation(s) in {self.clean_audits} "
                            "audits of clean runs (false positives)")
        if self.prefault_violations:
            problems.append(f"{self.prefault_violations} violation(s) in the clean state of "
                            "fault runs (false positives)")
        if self.unattributed:
            problems.append(f"{self.unattributed} finding(s) the audit could not attribute to a "
                            "plan entry")
        for error in self.errors[:MAX_REPORTED]:
            problems.append(f"{error['what']} (reproduce: {error['reproduce']})")
        return problems

    @property
    def passed(self) -> bool:
        return not self.failures()

    def to_dict(self) -> dict:
        rows = []
        for (backend, rules, target, kind, mode, scope), c in sorted(
                self.cells.items(), key=lambda kv: _row_order(kv[0])):
            should, why = designed(kind, mode, scope, rules, target)
            rows.append({"backend": backend, "rules": rules, "target": target, "kind": kind,
                         "mode": mode,
                         "scope": scope, "designed_to_see": should, "reason": why,
                         "rate": (c.detected / c.visible) if c.visible else None,
                         **c.to_dict()})
        return {
            "campaign": {"faults_per_kind": self.faults_per_kind, "clean_runs": self.clean_runs,
                         "seed": self.seed, "backends": self.backends,
                         "skipped_backends": self.skipped_backends, "jobs": self.jobs,
                         "fault_runs": self.fault_runs, "injections": self.injections,
                         "rounds": self.rounds,
                         "fault_runs_by_setting": {f"{k}={v}": n for (k, v), n in
                                                   sorted(self.mix.items(), key=str)},
                         "elapsed_s": round(self.elapsed_s, 2), "machine": self.machine},
            "cells": rows,
            "false_positives": {"clean_runs": self.clean_runs, "clean_audits": self.clean_audits,
                                "clean_violations": self.clean_violations,
                                "prefault_audits": self.prefault_audits,
                                "prefault_violations": self.prefault_violations,
                                "total": self.false_positive_count,
                                "examples": self.false_positives},
            "misses": {"count": self.miss_count, "examples": self.misses},
            "clean_runs": {"replaced": self.clean_replaced,
                           "lacking_a_class": [i for i, _ in self.clean_missing],
                           "class_entries": dict(sorted(self.clean_census.items())),
                           "class_entries_fewest_in_a_run": dict(
                               sorted(self.clean_census_min.items()))},
            "unattributed": self.unattributed,
            "errors": self.errors, "failures": self.failures(), "passed": self.passed,
        }


def _row_order(key):
    backend, rules, target, kind, mode, scope = key
    return (backend, RULES.index(rules), (TARGET_CLASSES + PAIR_SHAPES).index(target),
            FAULT_KINDS.index(kind), MODES.index(mode), scope)


def resolve_backends(name: str):
    """``(backends that run, {backend not run: why})`` for ``auto``, ``numpy`` or ``cupy``."""
    if name not in ("auto", "numpy", "cupy"):
        raise CampaignError(f"--backend must be auto, numpy or cupy, got {name!r}")
    if name == "numpy":
        return ["numpy"], {"cupy": "not requested (--backend numpy)"}
    if name == "cupy":
        try:
            resolve_backend("cupy")
        except AuditError as exc:
            raise CampaignError(f"--backend cupy: {exc}") from None
        return ["cupy"], {"numpy": "not requested (--backend cupy)"}
    from .cuda import CudaUnavailable, require_cupy

    try:
        require_cupy()
    except CudaUnavailable as exc:
        return ["numpy"], {"cupy": str(exc).removeprefix("kv-canary: ")}
    return ["numpy", "cupy"], {}


def machine_description() -> str:
    return f"{os.cpu_count()}-core {platform.machine()}, {platform.system()}"


def _worker_pool(jobs: int, cuda: bool) -> WorkerPool:
    # fork is cheaper, but a forked child would inherit a CUDA context it cannot use
    method = "spawn" if cuda or "fork" not in multiprocessing.get_all_start_methods() else "fork"
    return WorkerPool(jobs, start_method=method)


def _yield(target: str, kind: str, mode: str, scope: str, sources_share: float = 0.8) -> float:
    """Expected faults per run of a cell, to size a round (the next round fixes any error)."""
    n = CLASS_YIELD[target]
    if kind == "real-kv-byte":
        n *= sources_share * injections(kind, mode)
        if scope == LOW:
            n *= 0.55
        elif scope == HIGH:
            n *= 0.4
    return max(0.5, n * 0.95)


def run_campaign(*, faults_per_kind: int = DEFAULT_FAULTS_PER_KIND,
                 clean_runs: int = DEFAULT_CLEAN_RUNS, seed: int = 0,
                 backend: str = "auto", jobs: int | None = None, layout: str = "per-token",
                 progress=None) -> CampaignReport:
    """Run the campaign; ``progress(phase, done, total)`` is called as runs finish.
    ``layout="paged"`` plays paged engines (block tables) with the paged fault forms, without
    target classes (:mod:`kvcanary.campaign_paged`)."""
    if layout not in LAYOUTS:
        raise CampaignError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "paged":
        from . import campaign_paged
        return campaign_paged.run_campaign(faults_per_kind=faults_per_kind,
                                           clean_runs=clean_runs, seed=seed, backend=backend,
                                           jobs=jobs, layout=layout, progress=progress)
    if faults_per_kind < 1:
        raise CampaignError(f"--faults-per-kind must be at least 1, got {faults_per_kind}")
    if clean_runs < 0:
        raise CampaignError(f"--clean-runs must be at least 0, got {clean_runs}")
    if jobs is None:
        jobs = os.cpu_count() or 1
    if jobs < 1:
        raise CampaignError(f"--jobs must be at least 1, got {jobs}")
    if not 0 <= seed < 2 ** 63:
        raise CampaignError(f"--seed must be in [0, 2**63), got {seed}")
    started = time.perf_counter()
    backends, skipped = resolve_backends(backend)
    report = CampaignReport(faults_per_kind=faults_per_kind, clean_runs=clean_runs, seed=seed,
                            backends=backends, skipped_backends=skipped, jobs=jobs,
                            machine=machine_description())
    with _worker_pool(jobs, cuda="cupy" in backends) as runner:
        _clean_phase(report, runner, progress)
        _fault_phase(report, runner, progress)
    report.elapsed_s = time.perf_counter() - started
    return report


def _clean_phase(report, runner, progress) -> None:
    tasks = [{"index": index, "seed": report.seed, "backends": report.backends}
             for index in range(report.clean_runs)]
    for done, out in enumerate(runner.map(run_clean_task, tasks), 1):
        report.add_fp(out["fp"])
        _keep(report.false_positives, out["false_positives"])
        _keep(report.errors, out["errors"])
        report.clean_replaced += out["replaced"]
        if out["missing"]:
            report.clean_missing.append((out["index"], out["missing"]))
        for target, count in out["census"].items():
            report.clean_census[target] += count
            report.clean_census_min[target] = min(report.clean_census_min.get(target, count),
                                                  count)
        if progress:
            progress("clean runs", done, len(tasks))


def _keep(into: list, items: list) -> None:
    into.extend(items[:max(0, MAX_REPORTED - len(into))])


FAULT_PHASE = "faults toward the target"


def report_fault_progress(progress, injected: Counter, cells, target: int,
                          finished: bool = False) -> None:
    """``progress(FAULT_PHASE, done, total)``: faults injected toward ``target`` in every
    cell (a cell past its target counts as full). Rounds plan more runs as cells fall short,
    so a count of runs would go back; this one only grows, and reaches the total once, when
    the phase has finished."""
    if not progress:
        return
    total = target * len(cells)
    done = sum(min(injected[cell], target) for cell in cells)
    progress(FAULT_PHASE, done if finished else min(done, total - 1), total)


def _fault_phase(report, runner, progress) -> None:
    target = report.faults_per_kind
    injected = Counter()     # (target class, kind, mode, scope) -> faults
    cells = all_cells()
    index = 0
    while True:
        deficit = {cell: target - injected[cell] for cell in cells if injected[cell] < target}
        if not deficit:
            report_fault_progress(progress, injected, cells, target, finished=True)
            break
        report.rounds += 1
        if report.rounds > MAX_ROUNDS:
            raise CampaignError(f"internal: no convergence after {MAX_ROUNDS} rounds; short: "
                                + ", ".join(f"{t}/{k}/{m}{'/' + s if s else ''}"
                                            for t, k, m, s in deficit))
        tasks, first = [], index
        for mode in MODES:
            # Runs each short (class, kind) needs; run i of the round injects the pairs that
            # need more than i runs.
            need = Counter()
            for (t, k, m, s), n in deficit.items():
                if m == mode:
                    need[(t, k)] = max(need[(t, k)], math.ceil(n / _yield(t, k, mode, s)))
            if not need:
                continue
            for i in range(max(need.values())):
                rng = np.random.default_rng([report.seed, 0, index])
                config = sample_config(rng, mode)
                plan = []
                for k in FAULT_KINDS:
                    if k == "real-kv-byte" and config["sources"] == 0:
                        continue
                    targets = [(k, PER_INJECTION[t], t) for t in FILL_ORDER if need[(t, k)] > i]
                    if targets:
                        plan += [targets if j == 0 else targets[::-1]
                                 for j in range(injections(k, mode))]
                combos = rng.choice(len(PAIR_COMBOS), PAIR_COMBOS_PER_RUN, replace=False)
                plan.append([("+".join(PAIR_COMBOS[c]), PAIRS_PER_COMBO, shape)
                             for shape in PAIR_SHAPES for c in combos.tolist()])
                tasks.append({"index": index, "config": config, "backends": report.backends,
                              "plan": plan})
                index += 1
        for out in runner.map(run_fault_task, tasks):
            report.fault_runs += 1
            report.injections += len(out["injections"])
            config = tasks[out["index"] - first]["config"]
            for name in ("page_size", "swa_window", "sources", "bytes_per_token"):
                value = config[name] if name != "swa_window" else ("on" if config[name] else "off")
                report.mix[(name, value)] += 1
            report.add_fp(out["fp"])
            report.unattributed += out["unattributed"]
            _keep(report.false_positives, out["false_positives"])
            _keep(report.errors, out["errors"])
            report.miss_count += len(out["misses"])
            _keep(report.misses, out["misses"])
            for key, cell in out["cells"].items():
                backend, rules, t, kind, mode, scope = key.split("|")
                report.cells.setdefault((backend, rules, t, kind, mode, scope), Cell()).add(cell)
                if backend == report.backends[0] and rules == RULES[0]:
                    injected[(t, kind, mode, scope)] += cell.injected
            report_fault_progress(progress, injected, cells, target)


# --------------------------------------------------------------------------- rendering


def _fired_text(cell: Cell) -> str:
    return ", ".join(f"{label} {n}" for label, n in
                     sorted(cell.fired.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def table_rows(report: CampaignReport, backend: str, rules: str) -> list:
    """``[class, kind, mode, injected, detected, rate, sites, checks fired, status]`` per row."""
    rows = []
    for target in TARGET_CLASSES:
        for kind in FAULT_KINDS:
            for mode in MODES:
                for scope in scopes(kind, mode):
                    c = report.cell(backend, rules, target, kind, mode, scope)
                    should, why = designed(kind, mode, scope, rules, target)
                    name = f"{kind} ({scope})" if scope else kind
                    if should:
                        rate = f"{100.0 * c.detected / c.visible:.2f}%" if c.visible else "-"
                        status = "designed to see" + ("" if c.detected == c.visible else
                                                      f"; MISSED {c.visible - c.detected}")
                        rows.append([target, name, mode, str(c.injected), str(c.detected), rate,
                                     f"{c.sites} ({c.multi_row})", _fired_text(c), status])
                    else:
                        status = f"not designed to see: {why}" + (
                            f"; {c.stray} with findings at a site" if c.stray else "")
                        rows.append([target, name, mode, str(c.injected), "-", "n/a", "-",
                                     _fired_text(c), status])
    return rows


HEADER = ["target", "fault kind", "mode", "injected", "detected", "rate",
          "sites checked (2+ rows)", "checks fired at the sites", "status"]
NUMERIC = ("injected", "detected", "rate", "sites checked (2+ rows)")
CLASS_HEADER = ["target", "injected", "designed to see", "detected", "rate",
                "not designed to see", "sites checked", "faults seen by 2+ request rows"]


def class_rows(report: CampaignReport, backend: str, rules: str,
               targets=TARGET_CLASSES) -> list:
    """Totals per target class (or pair shape): ``CLASS_HEADER`` columns."""
    rows = []
    for target in targets:
        total = Cell()
        for (b, r, t, _, _, _), cell in report.cells.items():
            if (b, r, t) == (backend, rules, target):
                total.add(cell)
        rate = f"{100.0 * total.detected / total.visible:.2f}%" if total.visible else "-"
        rows.append([target, str(total.injected), str(total.visible), str(total.detected), rate,
                     str(total.injected - total.visible), str(total.sites),
                     str(total.multi_row)])
    return rows


def _summary_lines(report: CampaignReport) -> list:
    r = report
    ran = ", ".join(r.backends)
    skipped = "; ".join(f"{b} not run: {why}" for b, why in r.skipped_backends.items())
    total = sum(r.cell(r.backends[0], RULES[0], *cell).injected for cell in all_cells())
    census = ", ".join(f"{t} {r.clean_census[t]}" for t in TARGET_CLASSES)
    fewest = ", ".join(f"{t} {r.clean_census_min.get(t, 0)}" for t in CLEAN_RUN_CLASSES)
    lines = [
        f"seed {r.seed}, {r.faults_per_kind} faults per kind and mode at least, "
        f"{r.clean_runs} clean runs, {r.jobs} job(s), {r.elapsed_s:.1f} s on {r.machine}",
        f"backends: {ran}" + (f" ({skipped})" if skipped else ""),
        f"workloads: {r.fault_runs} fault runs in {r.rounds} round(s), {r.injections} "
        f"injections, {total} faults injected at {len(TARGET_CLASSES)} target classes, each "
        f"audited on every backend with kvcanary's rules and with --compat; page sizes "
        f"1/16/64, SWA on and off, 0-4 real-KV sources, modes none/partial/all",
        f"clean runs: {r.clean_runs - len(r.clean_missing)} of {r.clean_runs} verify shared "
        f"prefix-cache entries, a window head and a chunk boundary (fewest in one run: "
        f"{fewest}; {r.clean_replaced} sampled workloads without them replaced); entries "
        f"verified over all clean runs by class: {census}",
        f"false positives: {r.false_positive_count} ({r.clean_violations} violations in "
        f"{r.clean_audits} audits of {r.clean_runs} clean runs, {r.prefault_violations} in "
        f"{r.prefault_audits} audits of fault runs before injection, "
        f"{sum(1 for e in r.errors if e['what'].startswith('simulation failed'))} in-run "
        "verify failures)",
        "fault runs by setting: " + "; ".join(
            f"{words} " + ", ".join(f"{value}: {r.mix[(name, value)]}" for value in values)
            for name, words, values in (("page_size", "page size", PAGE_SIZES),
                                        ("swa_window", "SWA", ("off", "on")),
                                        ("sources", "real-KV sources", range(5)),
                                        ("bytes_per_token", "KV bytes per token",
                                         BYTES_PER_TOKEN))),
        f"unattributed findings: {r.unattributed}",
    ]
    return lines


def _verdict_lines(report: CampaignReport) -> list:
    failures = report.failures()
    if not failures:
        return ["PASS: every fault the canary is designed to see was detected (100%), "
                "0 false positives"]
    lines = [f"FAIL: {len(failures)} target(s) missed"]
    lines += [f"- {f}" for f in failures[:MAX_REPORTED]]
    for miss in report.misses:
        lines.append(
            f"- missed {miss['kind']} at a {miss['target']} entry (mode {miss['mode']}, "
            f"{miss['backend']}, {miss['rules']}): "
            f"request row {miss['request_row']}, position {miss['position']}, slot "
            f"{miss['slot']}, detail {miss['detail']}; expected {'+'.join(miss['expected'])}, "
            f"fired {'+'.join(miss['fired']) or 'nothing'}; seed {miss['config']['seed']}; "
            f"reproduce: {miss['reproduce']}")
    if report.miss_count > len(report.misses):
        lines.append(f"- ... {report.miss_count - len(report.misses)} more misses (see --format json)")
    for fp in report.false_positives:
        lines.append(f"- false positive in {fp['where']} ({fp['backend']}, {fp['rules']}): "
                     f"{fp['violations']} violation(s), first {fp['first']} at {fp['at']}; "
                     f"reproduce: {fp['reproduce']}")
    return lines


def _markdown_table(header: list, rows: list) -> list:
    out = ["| " + " | ".join(header) + " |",
           "| " + " | ".join("---" if i == 0 or header[i] in ("fault kind", "mode", "status",
                                                               "checks fired at the sites")
                             else "---:" for i in range(len(header))) + " |"]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return out


def render_markdown(report: CampaignReport) -> str:
    out = ["## kvcanary coverage campaign", ""]
    out += [f"- {line}" for line in _summary_lines(report)]
    for backend in report.backends:
        for rules in RULES:
            out += ["", f"### {backend} backend, {RULE_WORDS[rules]}: totals by target class", ""]
            out += _markdown_table(CLASS_HEADER, class_rows(report, backend, rules))
    out += ["", "### Interacting faults (pairs, each fault scored at its own sites)", ""]
    out += _markdown_table(["backend", "rules"] + CLASS_HEADER, [
        [backend, rules] + row for backend in report.backends for rules in RULES
        for row in class_rows(report, backend, rules, PAIR_SHAPES)])
    out += [""] + [f"- not paired: {a} + {b}: {why}" for (a, b), why in PAIRS_NOT_UNION.items()]
    for backend in report.backends:
        for rules in RULES:
            out += ["", f"### {backend} backend, {RULE_WORDS[rules]}", ""]
            out += _markdown_table(HEADER, table_rows(report, backend, rules))
    out += ["", "### False positives", "",
            "| backend | rules | clean-run audits | violations | pre-injection audits | violations |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    for backend in report.backends:
        for rules in RULES:
            clean = report.fp.get(("clean", backend, rules), [0, 0])
            prefault = report.fp.get(("prefault", backend, rules), [0, 0])
            out.append(f"| {backend} | {rules} | {clean[0]} | {clean[1]} | {prefault[0]} | "
                       f"{prefault[1]} |")
    out += ["", "### Verdict", ""] + _verdict_lines(report)
    return "\n".join(out) + "\n"


def render_text(report: CampaignReport) -> str:
    out = ["kvcanary coverage campaign"] + [f"  {line}" for line in _summary_lines(report)]
    for backend in report.backends:
        for rules in RULES:
            rows = [HEADER] + table_rows(report, backend, rules)
            widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
            out += ["", f"{backend} backend, {RULE_WORDS[rules]}:"]
            for n, row in enumerate(rows):
                cells = [row[i].rjust(widths[i]) if HEADER[i] in NUMERIC
                         else row[i].ljust(widths[i]) for i in range(len(widths))]
                out.append("  ".join(cells + [row[-1]]).rstrip())
                if n == 0:
                    out.append("-" * (sum(widths) + 2 * len(widths) + len("status")))
    out += ["", "interacting pairs:"]
    for backend in report.backends:
        for rules in RULES:
            for row in class_rows(report, backend, rules, PAIR_SHAPES):
                out.append(f"  {backend} {rules} {row[0]}: {row[1]} faults, {row[3]} of "
                           f"{row[2]} detected ({row[4]})")
    out += [""] + _verdict_lines(report)
    return "\n".join(out) + "\n"


def render(report: CampaignReport, fmt: str) -> str:
    if getattr(report, "layout", "per-token") == "paged":
        from . import campaign_paged
        return campaign_paged.render(report, fmt)
    if fmt == "markdown":
        return render_markdown(report)
    if fmt == "json":
        return json.dumps(report.to_dict(), indent=2) + "\n"
    if fmt == "text":
        return render_text(report)
    raise CampaignError(f"--format must be text, markdown or json, got {fmt!r}")
