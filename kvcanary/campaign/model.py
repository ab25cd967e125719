"""The campaign's report model: one :class:`Cell` of counts per table row, keyed by
``(backend, rules)`` and the layout's cell tuple ``(target class, kind, mode, scope)``, and
the :class:`CampaignReport` that holds them with the false-positive counts, the misses and
the verdict (:meth:`CampaignReport.failures`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..format.errors import ToolError
from ..synth import MODES
from .layouts import LAYOUTS, RULES, designed

MAX_REPORTED = 25   # misses and false positives kept in full
CLEAN_RUN_ATTEMPTS = 20


class CampaignError(ToolError):
    """A bad campaign option (the message names it) or an unusable backend."""


@dataclass
class Cell:
    """Faults of one table row, and what the audit made of them."""
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


def cell_label(target: str, kind: str, mode: str, scope: str) -> str:
    return f"{kind}{' (' + scope + ')' if scope else ''} at {target} entries in mode {mode}"


@dataclass
class CampaignReport:
    """A campaign's counts; ``passed`` when :meth:`failures` is empty."""
    faults_per_kind: int
    clean_runs: int
    seed: int
    backends: list
    skipped_backends: dict
    jobs: int
    layout: str = "per-token"
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

    @property
    def form(self):
        """The :class:`~kvcanary.campaign.layouts.Layout` of the run."""
        return LAYOUTS[self.layout]

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
    def in_run_failures(self) -> int:
        return sum(1 for e in self.errors if e["what"].startswith("simulation failed"))

    @property
    def false_positive_count(self) -> int:
        return self.clean_violations + self.prefault_violations + self.in_run_failures

    @property
    def stray(self) -> int:
        return sum(c.stray for c in self.cells.values())

    def failures(self) -> list:
        """The targets missed, one sentence each (empty: every target met)."""
        problems = []
        for (backend, rules, *key), c in sorted(self.cells.items()):
            label = f"{cell_label(*key)}, {backend}, {rules}"
            if c.detected < c.visible:
                problems.append(f"{label}: {c.visible - c.detected} of {c.visible} faults the "
                                "canary is designed to see were missed")
            if c.stray:
                problems.append(f"{label}: {c.stray} faults the canary is not designed to see "
                                "had findings at their target (faults interacting?)")
        for key in self.form.cells():
            injected = self.cell(self.backends[0], RULES[0], *key).injected
            if injected < self.faults_per_kind:
                problems.append(f"{cell_label(*key)}: only {injected} faults injected, "
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

    def _row_order(self, key):
        backend, rules, target, kind, mode, scope = key
        form = self.form
        return (backend, RULES.index(rules), (form.targets + form.pair_shapes).index(target),
                form.kinds.index(kind), MODES.index(mode), scope)

    def to_dict(self) -> dict:
        """Everything above as plain JSON values (``kvcanary campaign --format json``)."""
        rows = []
        for (backend, rules, target, kind, mode, scope), c in sorted(
                self.cells.items(), key=lambda kv: self._row_order(kv[0])):
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
            "clean_runs": {"replaced": self.clean_replaced,
                           "lacking_a_class": [i for i, _ in self.clean_missing],
                           "class_entries": dict(sorted(self.clean_census.items())),
                           "class_entries_fewest_in_a_run": dict(
                               sorted(self.clean_census_min.items()))},
            "unattributed": self.unattributed,
            "errors": self.errors, "failures": self.failures(), "passed": self.passed,
        }
