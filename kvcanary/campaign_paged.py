"""The coverage campaign behind ``kvcanary campaign --layout paged`` (the per-token layout,
with target classes, is :mod:`kvcanary.campaign`): measure, over many randomized synth
workloads, that the audit detects every injected fault it is designed to see and reports
nothing on clean workloads.

One *fault run* samples a small paged workload (block size 4, 16 or 32; SWA on or off; 0 to 4
real-KV sources; the hash mode of the run), plays it with :class:`~kvcanary.synth.Synthesis`,
audits the clean final state, injects a few faults of every kind still short of its target,
audits again on every backend and under both rule sets (kvcanary's, and ``--compat``:
upstream's only), and scores each fault with :func:`kvcanary.synth.score` at its target entry.
Faults of one run never interact: synth gives every fault its own request-owned entry and
slot, and no two targets of a request are neighbours (a content fault breaks its successor's
chain link, which is therefore never another fault's target). A fault whose target shows a
finding although the canary is not designed to see it would reveal such crosstalk; the
campaign counts these and fails on any.

Rounds of runs are planned from the remaining deficits until every (kind, mode) cell holds at
least ``faults_per_kind`` faults; ``real-kv-byte`` in partial mode is split at the 16 bytes
partial mode hashes, and each half must reach the target. *Clean runs* are further randomized
workloads audited without faults; every violation there, in the clean state of a fault run
before its injection, or in a simulation's own in-run verify, is a false positive.

Every run is a function of the campaign seed and its index, independent of ``jobs``; a miss
is reported with the ``kvcanary synth`` / ``kvcanary audit`` commands that reproduce it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shlex
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .consts import REAL_KV_PARTIAL_READ_BYTES
from .synth import (
    MODES,
    SynthError,
    fault_kinds,
    faults_from_dump,
    score,
)
from .campaign import (
    BYTES_PER_TOKEN,
    DEFAULT_CLEAN_RUNS,
    DEFAULT_FAULTS_PER_KIND,
    HIGH,
    LAYOUTS,
    LOW,
    MAX_REPORTED,
    MAX_ROUNDS,
    PAGE_SIZES,
    RULE_WORDS,
    RULES,
    CampaignError,
    _audits,
    _dump,
    _false_positive,
    _fired_text,
    _fp_key,
    _keep,
    _synthesis,
    _worker_pool,
    audit_command,
    fault_scope,
    machine_description,
    report_fault_progress,
    resolve_backends,
    scopes,
)
from .violations import reason_labels

# The paged layout (synth --block-size): block sizes, and prompts long enough that a request
# owns several whole blocks (block faults claim a block and its neighbours).
BLOCK_SIZES = (4, 16, 32)
PAGED_PROMPT_LEN = (16, 96)
PAGED_SLOTS = (2048, 4096)


def per_run(kind: str, mode: str) -> int:
    """Faults of one kind per run. The k-th real-kv-byte fault of a run lands in 16-byte
    window k of the slot (modulo its size), so 4 cover a 64-byte slot; partial mode, whose
    table splits at 16 bytes, gets 8. A run has few cached blocks that live requests map,
    so evicted-block gets 1."""
    if kind == "real-kv-byte":
        return 8 if mode == "partial" else 4
    if kind == "evicted-block":
        return 1
    return 3


# --------------------------------------------------------------------------- cells


def designed(kind: str, mode: str, scope: str, rules: str):
    """``(True, "")`` where the canary is designed to see the fault, else ``(False, why)``."""
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


def layout_kinds(layout: str) -> tuple:
    return fault_kinds(layout == "paged")


def all_cells(layout: str = "per-token"):
    return [(kind, mode, scope) for kind in layout_kinds(layout) for mode in MODES
            for scope in scopes(kind, mode)]


@dataclass
class Cell:
    injected: int = 0
    visible: int = 0            # faults the canary is designed to see (ground truth)
    detected: int = 0           # visible faults whose expected bits fired at the target
    stray: int = 0              # invisible faults with a finding at the target (crosstalk)
    fired: Counter = field(default_factory=Counter)   # label -> faults where it fired

    def add(self, other: "Cell") -> None:
        self.injected += other.injected
        self.visible += other.visible
        self.detected += other.detected
        self.stray += other.stray
        self.fired.update(other.fired)

    def to_dict(self) -> dict:
        return {"injected": self.injected, "visible": self.visible, "detected": self.detected,
                "stray": self.stray, "fired": dict(sorted(self.fired.items()))}


# --------------------------------------------------------------------------- workloads


def sample_config(rng: np.random.Generator, mode: str, *, clean: bool = False,
                  layout: str = "per-token") -> dict:
    """A small randomized workload whose every field is a ``kvcanary synth`` option."""
    config = _sample_per_token(rng, mode, clean)
    if layout == "paged":   # drawn after the per-token fields: those runs stay as they were
        block_size = int(rng.choice(BLOCK_SIZES))
        config.update(page_size=block_size, block_size=block_size,
                      num_slots=int(rng.choice(PAGED_SLOTS)), prompt_len=PAGED_PROMPT_LEN)
    return config


def _sample_per_token(rng: np.random.Generator, mode: str, clean: bool) -> dict:
    swa = int(rng.integers(24, 65)) if rng.random() < 0.5 else 0
    return dict(
        requests=int(rng.integers(16, 33)),
        num_slots=int(rng.choice((1024, 2048))),
        max_running=int(rng.integers(4, 9)),
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
    pages = (["--block-size", c["block_size"]] if c.get("block_size") else
             ["--page-size", c["page_size"]])
    args = ["kvcanary", "synth", "repro.npz", "--requests", c["requests"],
            "--slots", c["num_slots"], "--max-running", c["max_running"],
            *pages, "--swa-window", c["swa_window"],
            "--sources", c["sources"], "--bytes-per-token", c["bytes_per_token"],
            "--mode", c["mode"], "--chunk-size", c["chunk_size"],
            "--prompt-len", "{}..{}".format(*c["prompt_len"]),
            "--output-len", "{}..{}".format(*c["output_len"]),
            "--verify-every", c["verify_every"], "--seed", c["seed"]]
    for kind, count in inject:
        args += ["--inject", f"{kind}:{count}"]
    return " ".join(shlex.quote(str(a)) for a in args)


def _simulate_and_audit_clean(out: dict, config, backends, phase: str, what: str):
    """Play ``config`` and audit its (fault-free) final state on every backend and rule
    set, counting audits and any violation as a false positive under ``phase``. Returns the
    simulation, or None when it failed (recorded as an error: an honest run whose in-run
    verify fired)."""
    try:
        synthesis = _synthesis(config)
    except SynthError as exc:
        out["errors"].append({"what": f"simulation failed: {str(exc).splitlines()[0]}",
                              "config": config, "reproduce": synth_command(config)})
        return None
    for backend, rules, result in _audits(_dump(synthesis.arrays()), backends):
        key = _fp_key(phase, backend, rules)
        audits, violations = out["fp"].get(key, (0, 0))
        out["fp"][key] = (audits + 1, violations + result.total_violations)
        if result.total_violations:
            out["false_positives"].append(
                _false_positive(what, config, backend, rules, result))
    return synthesis


def _inject_plans(inject):
    """The plan, then smaller ones, for a workload whose live set is too small for it."""
    yield list(inject)
    yield [(kind, max(1, count // 2)) for kind, count in inject]
    ones = [(kind, 1) for kind, _ in inject]
    for keep in range(len(ones), 0, -1):
        yield ones[:keep]


def run_fault_task(task: dict) -> dict:
    """One fault run (see the module docstring); runs in a worker process too."""
    config, backends = task["config"], task["backends"]
    out = {"index": task["index"], "cells": {}, "misses": [], "false_positives": [],
           "errors": [], "fp": {}, "shortages": 0, "unattributed": 0, "inject": [],
           "targets": []}
    clean = _simulate_and_audit_clean(out, config, backends, "prefault",
                                      "clean state of a fault run")
    if clean is None:
        return out
    # Every injection of the plan must succeed, so that ``kvcanary synth --inject`` rebuilds
    # exactly these faults; a live set too small for the plan gets a smaller one.
    synthesis, done = None, []
    for plan in _inject_plans(task["inject"]):
        attempt = copy.deepcopy(clean)
        try:
            for kind, count in plan:
                attempt.inject(kind, count)
        except SynthError:
            out["shortages"] += 1
            continue
        synthesis, done = attempt, plan
        break
    out["inject"] = done
    if synthesis is None:
        return out
    d = _dump(synthesis.arrays())
    faults = faults_from_dump(d)
    out["targets"] = [(f.kind, f.request_row, f.position, f.slot) for f in faults]
    mode = config["mode"]
    for backend, rules, result in _audits(d, backends):
        out["unattributed"] += result.unattributed
        for fault, outcome in zip(faults, score(faults, result)):
            scope = fault_scope(fault.kind, mode, fault.detail)
            key = "|".join((backend, rules, fault.kind, mode, scope))
            cell = out["cells"].setdefault(key, Cell())
            cell.injected += 1
            should, _ = designed(fault.kind, mode, scope, rules)
            if outcome.visible != should:
                out["errors"].append({
                    "what": f"{fault.kind} fault: synth's ground truth says visible="
                            f"{outcome.visible}, the campaign's table says {should}",
                    "config": config, "reproduce": synth_command(config, done)})
            labels = reason_labels(outcome.fired_bits)
            if should:
                cell.visible += 1
                cell.fired.update(labels)
                if outcome.detected:
                    cell.detected += 1
                else:
                    out["misses"].append({
                        "backend": backend, "rules": rules, "kind": fault.kind, "mode": mode,
                        "scope": scope, "request_row": fault.request_row,
                        "position": fault.position, "slot": fault.slot, "detail": fault.detail,
                        "expected": reason_labels(fault.expected_bits), "fired": labels,
                        "note": outcome.note, "config": config, "inject": done,
                        "reproduce": synth_command(config, done) + " && "
                                     + audit_command(backend, rules)})
            elif outcome.fired_bits:
                cell.stray += 1
                cell.fired.update(labels)
    return out


def run_clean_task(task: dict) -> dict:
    config, backends = task["config"], task["backends"]
    out = {"index": task["index"], "fp": {}, "false_positives": [], "errors": []}
    _simulate_and_audit_clean(out, config, backends, "clean", "clean run")
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
    layout: str = "per-token"
    cells: dict = field(default_factory=dict)        # (backend, rules, kind, mode, scope) -> Cell
    fault_runs: int = 0
    rounds: int = 0
    shortages: int = 0
    unattributed: int = 0
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

    def cell(self, backend, rules, kind, mode, scope="") -> Cell:
        return self.cells.get((backend, rules, kind, mode, scope), Cell())

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
        for (backend, rules, kind, mode, scope), c in sorted(self.cells.items()):
            label = f"{kind}{' (' + scope + ')' if scope else ''} in mode {mode}, {backend}, {rules}"
            if c.detected < c.visible:
                problems.append(f"{label}: {c.visible - c.detected} of {c.visible} faults the "
                                "canary is designed to see were missed")
            if c.stray:
                problems.append(f"{label}: {c.stray} faults the canary is not designed to see "
                                "had findings at their target (faults interacting?)")
        for kind, mode, scope in all_cells(self.layout):
            injected = self.cell(self.backends[0], RULES[0], kind, mode, scope).injected
            if injected < self.faults_per_kind:
                problems.append(f"{kind} in mode {mode}: only {injected} faults injected, "
                                f"target {self.faults_per_kind}")
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
        for (backend, rules, kind, mode, scope), c in sorted(
                self.cells.items(), key=lambda kv: _row_order(kv[0])):
            should, why = designed(kind, mode, scope, rules)
            rows.append({"backend": backend, "rules": rules, "kind": kind, "mode": mode,
                         "scope": scope, "designed_to_see": should, "reason": why,
                         "rate": (c.detected / c.visible) if c.visible else None,
                         **c.to_dict()})
        return {
            "campaign": {"faults_per_kind": self.faults_per_kind, "clean_runs": self.clean_runs,
                         "seed": self.seed, "backends": self.backends,
                         "skipped_backends": self.skipped_backends, "jobs": self.jobs,
                         "fault_runs": self.fault_runs, "rounds": self.rounds,
                         "fault_runs_by_setting": {f"{k}={v}": n for (k, v), n in
                                                   sorted(self.mix.items(), key=str)},
                         "elapsed_s": round(self.elapsed_s, 2), "machine": self.machine,
                         **({"layout": self.layout} if self.layout != "per-token" else {})},
            "cells": rows,
            "false_positives": {"clean_runs": self.clean_runs, "clean_audits": self.clean_audits,
                                "clean_violations": self.clean_violations,
                                "prefault_audits": self.prefault_audits,
                                "prefault_violations": self.prefault_violations,
                                "total": self.false_positive_count,
                                "examples": self.false_positives},
            "misses": {"count": self.miss_count, "examples": self.misses},
            "unattributed": self.unattributed, "shortages": self.shortages,
            "errors": self.errors, "failures": self.failures(), "passed": self.passed,
        }


def _row_order(key):
    backend, rules, kind, mode, scope = key
    return (backend, RULES.index(rules), layout_kinds("paged").index(kind), MODES.index(mode),
            scope)


def _yield(kind: str, mode: str, scope: str, sources_share: float = 0.8) -> float:
    """Expected faults per run of a cell, to size a round (the next round fixes any error)."""
    n = per_run(kind, mode)
    if kind == "real-kv-byte":
        n *= sources_share
        if scope == LOW:
            n *= 0.55
        elif scope == HIGH:
            n *= 0.4
    return max(0.5, n * 0.9)


def run_campaign(*, faults_per_kind: int = DEFAULT_FAULTS_PER_KIND,
                 clean_runs: int = DEFAULT_CLEAN_RUNS, seed: int = 0,
                 backend: str = "auto", jobs: int | None = None, layout: str = "per-token",
                 progress=None) -> CampaignReport:
    """Run the campaign; ``progress(phase, done, total)`` is called as runs finish.
    ``layout="paged"`` plays paged engines (block tables) with the paged fault forms."""
    if layout not in LAYOUTS:
        raise CampaignError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
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
                            layout=layout, machine=machine_description())
    with _worker_pool(jobs, cuda="cupy" in backends) as runner:
        _clean_phase(report, runner, progress)
        _fault_phase(report, runner, progress)
    report.elapsed_s = time.perf_counter() - started
    return report


def _clean_phase(report, runner, progress) -> None:
    tasks = []
    for index in range(report.clean_runs):
        rng = np.random.default_rng([report.seed, 1, index])
        mode = MODES[int(rng.integers(len(MODES)))]
        tasks.append({"index": index, "backends": report.backends,
                      "config": sample_config(rng, mode, clean=True, layout=report.layout)})
    for done, out in enumerate(runner.map(run_clean_task, tasks), 1):
        report.add_fp(out["fp"])
        _keep(report.false_positives, out["false_positives"])
        _keep(report.errors, out["errors"])
        if progress:
            progress("clean runs", done, len(tasks))


def _fault_phase(report, runner, progress) -> None:
    target = report.faults_per_kind
    injected = Counter()     # (kind, mode, scope) -> faults
    cells = all_cells(report.layout)
    index = 0
    while True:
        deficit = {cell: target - injected[cell] for cell in cells if injected[cell] < target}
        if not deficit:
            report_fault_progress(progress, injected, cells, target, finished=True)
            break
        report.rounds += 1
        if report.rounds > MAX_ROUNDS:
            raise CampaignError(f"internal: no convergence after {MAX_ROUNDS} rounds; short: "
                                + ", ".join(f"{k}/{m}{'/' + s if s else ''}"
                                            for k, m, s in deficit))
        tasks, first = [], index
        for mode in MODES:
            short = {(k, s): n for (k, m, s), n in deficit.items() if m == mode}
            if not short:
                continue
            # Runs each short kind needs; run i of the round injects the kinds that need more
            # than i runs.
            need = Counter()
            for (k, s), n in short.items():
                need[k] = max(need[k], math.ceil(n / _yield(k, mode, s)))
            for i in range(max(need.values())):
                rng = np.random.default_rng([report.seed, 0, index])
                config = sample_config(rng, mode, layout=report.layout)
                inject = [(k, per_run(k, mode)) for k in layout_kinds(report.layout) if need[k] > i
                          and not (k == "real-kv-byte" and config["sources"] == 0)]
                order = rng.permutation(len(inject)).tolist()
                tasks.append({"index": index, "config": config, "backends": report.backends,
                              "inject": [inject[i] for i in order]})
                index += 1
        for out in runner.map(run_fault_task, tasks):
            report.fault_runs += 1
            config = tasks[out["index"] - first]["config"]
            for name in (_mix_settings(report.layout)[0][0], "swa_window", "sources",
                         "bytes_per_token"):
                value = config[name] if name != "swa_window" else ("on" if config[name] else "off")
                report.mix[(name, value)] += 1
            report.add_fp(out["fp"])
            report.shortages += out["shortages"]
            report.unattributed += out["unattributed"]
            _keep(report.false_positives, out["false_positives"])
            _keep(report.errors, out["errors"])
            report.miss_count += len(out["misses"])
            _keep(report.misses, out["misses"])
            for key, cell in out["cells"].items():
                backend, rules, kind, mode, scope = key.split("|")
                report.cells.setdefault((backend, rules, kind, mode, scope), Cell()).add(cell)
                if backend == report.backends[0] and rules == RULES[0]:
                    injected[(kind, mode, scope)] += cell.injected
            report_fault_progress(progress, injected, cells, target)


# --------------------------------------------------------------------------- rendering


def table_rows(report: CampaignReport, backend: str, rules: str) -> list:
    """``[kind, mode, injected, detected, rate, checks fired, status]`` per row."""
    rows = []
    for kind in layout_kinds(report.layout):
        for mode in MODES:
            for scope in scopes(kind, mode):
                c = report.cell(backend, rules, kind, mode, scope)
                should, why = designed(kind, mode, scope, rules)
                name = f"{kind} ({scope})" if scope else kind
                if should:
                    rate = f"{100.0 * c.detected / c.visible:.2f}%" if c.visible else "-"
                    status = "designed to see" + ("" if c.detected == c.visible else
                                                  f"; MISSED {c.visible - c.detected}")
                    rows.append([name, mode, str(c.injected), str(c.detected), rate,
                                 _fired_text(c), status])
                else:
                    status = f"not designed to see: {why}" + (
                        f"; {c.stray} with findings at the target" if c.stray else "")
                    rows.append([name, mode, str(c.injected), "-", "n/a", _fired_text(c), status])
    return rows


HEADER = ["fault kind", "mode", "injected", "detected", "rate", "checks fired at the target",
          "status"]


def _summary_lines(report: CampaignReport) -> list:
    r = report
    ran = ", ".join(r.backends)
    skipped = "; ".join(f"{b} not run: {why}" for b, why in r.skipped_backends.items())
    total = sum(r.cell(r.backends[0], RULES[0], *cell).injected for cell in all_cells(r.layout))
    tables = ("page sizes 1/16/64" if r.layout == "per-token" else
              "paged: block tables of {}-slot blocks".format("/".join(map(str, BLOCK_SIZES))))
    lines = [
        f"seed {r.seed}, {r.faults_per_kind} faults per kind and mode at least, "
        f"{r.clean_runs} clean runs, {r.jobs} job(s), {r.elapsed_s:.1f} s on {r.machine}",
        f"backends: {ran}" + (f" ({skipped})" if skipped else ""),
        f"workloads: {r.fault_runs} fault runs in {r.rounds} round(s), {total} faults "
        f"injected, each audited on every backend with kvcanary's rules and with --compat; "
        f"{tables}, SWA on and off, 0-4 real-KV sources, modes none/partial/all",
        f"false positives: {r.false_positive_count} ({r.clean_violations} violations in "
        f"{r.clean_audits} audits of {r.clean_runs} clean runs, {r.prefault_violations} in "
        f"{r.prefault_audits} audits of fault runs before injection, "
        f"{sum(1 for e in r.errors if e['what'].startswith('simulation failed'))} in-run "
        "verify failures)",
        "fault runs by setting: " + "; ".join(
            f"{words} " + ", ".join(f"{value}: {r.mix[(name, value)]}" for value in values)
            for name, words, values in (*_mix_settings(r.layout),
                                        ("swa_window", "SWA", ("off", "on")),
                                        ("sources", "real-KV sources", range(5)),
                                        ("bytes_per_token", "KV bytes per token",
                                         BYTES_PER_TOKEN))),
        f"unattributed findings: {r.unattributed}; fault plans reduced to fit a small live "
        f"set: {r.shortages}",
    ]
    return lines


def _mix_settings(layout: str) -> tuple:
    """The layout's own setting in the "fault runs by setting" line."""
    if layout == "paged":
        return (("block_size", "block size", BLOCK_SIZES),)
    return (("page_size", "page size", PAGE_SIZES),)


def _verdict_lines(report: CampaignReport) -> list:
    failures = report.failures()
    if not failures:
        return ["PASS: every fault the canary is designed to see was detected (100%), "
                "0 false positives"]
    lines = [f"FAIL: {len(failures)} target(s) missed"]
    lines += [f"- {f}" for f in failures[:MAX_REPORTED]]
    for miss in report.misses:
        lines.append(
            f"- missed {miss['kind']} (mode {miss['mode']}, {miss['backend']}, {miss['rules']}): "
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


def render_markdown(report: CampaignReport) -> str:
    out = ["## kvcanary coverage campaign" + _layout_title(report), ""]
    out += [f"- {line}" for line in _summary_lines(report)]
    for backend in report.backends:
        for rules in RULES:
            out += ["", f"### {backend} backend, {RULE_WORDS[rules]}", ""]
            out.append("| " + " | ".join(HEADER) + " |")
            out.append("| " + " | ".join("---:" if h in ("injected", "detected", "rate") else "---"
                                         for h in HEADER) + " |")
            for row in table_rows(report, backend, rules):
                out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
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
    out = ["kvcanary coverage campaign" + _layout_title(report)]
    out += [f"  {line}" for line in _summary_lines(report)]
    for backend in report.backends:
        for rules in RULES:
            rows = [HEADER] + table_rows(report, backend, rules)
            widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
            out += ["", f"{backend} backend, {RULE_WORDS[rules]}:"]
            for n, row in enumerate(rows):
                cells = [row[i].rjust(widths[i]) if HEADER[i] in ("injected", "detected", "rate")
                         else row[i].ljust(widths[i]) for i in range(len(widths))]
                out.append("  ".join(cells + [row[-1]]).rstrip())
                if n == 0:
                    out.append("-" * (sum(widths) + 2 * len(widths) + len("status")))
    out += [""] + _verdict_lines(report)
    return "\n".join(out) + "\n"


def _layout_title(report: CampaignReport) -> str:
    return ", paged layout (block tables)" if report.layout == "paged" else ""


def render(report: CampaignReport, fmt: str) -> str:
    if fmt == "markdown":
        return render_markdown(report)
    if fmt == "json":
        return json.dumps(report.to_dict(), indent=2) + "\n"
    if fmt == "text":
        return render_text(report)
    raise CampaignError(f"--format must be text, markdown or json, got {fmt!r}")
