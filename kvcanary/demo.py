"""The demo behind ``kvcanary demo``: synthesise a workload, audit it clean, inject every
fault kind, audit again and score each injected fault against the audit's findings."""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field

from .audit import audit
from .dump import load, save
from .synth import FAULT_KINDS, Synthesis, SynthConfig, faults_from_dump, score
from .violations import reason_labels

DEMO_CONFIG = dict(requests=48, num_slots=2048, max_running=16, sources=2, bytes_per_token=32)
# Two real-KV byte faults: the first lands in the leading 16 bytes, the second after them, so
# partial mode shows one fault it sees and one it cannot.
DEMO_FAULTS = tuple((kind, 2 if kind == "real-kv-byte" else 1) for kind in FAULT_KINDS)


@dataclass
class KindRow:
    kind: str
    injected: int = 0
    detected: int = 0
    invisible: int = 0
    missed: int = 0
    fired: set = field(default_factory=set)
    notes: list = field(default_factory=list)


@dataclass
class DemoReport:
    synthesis: Synthesis
    clean: object
    faulty: object
    outcomes: list
    rows: list
    kept: tuple = ()   # (clean, faulty) dump paths when a workdir was given

    @property
    def passed(self) -> bool:
        return self.clean.clean and all(row.missed == 0 for row in self.rows)

    @property
    def faults(self) -> int:
        return sum(row.injected for row in self.rows)

    def example(self):
        """A finding to show: the first one at an injected fault's entry that also breaks
        the next token's chain link (a changed token), else the first finding."""
        findings = self.faulty.findings
        token = [o for o in self.outcomes if o.kind == "token" and o.detected]
        for outcome in token:
            for finding in findings:
                if (finding.request_row, finding.position) == (outcome.request_row,
                                                               outcome.position):
                    return finding
        return findings[0] if findings else None


# The dumps ``run_demo`` writes into its ``workdir``.
KEPT_DUMPS = ("clean.npz", "faulty.npz")


def run_demo(*, mode: str = "partial", seed: int = 0, backend: str = "auto",
             workdir: str | None = None, compat: bool = False, progress=None,
             **overrides) -> DemoReport:
    config = SynthConfig(**{**DEMO_CONFIG, **overrides, "mode": mode, "seed": seed})
    with tempfile.TemporaryDirectory(prefix="kvcanary-demo-") as scratch:
        where = workdir or scratch
        os.makedirs(where, exist_ok=True)
        synthesis = Synthesis(config).run(progress=progress)
        clean_path, faulty_path = (os.path.join(where, name) for name in KEPT_DUMPS)
        save(clean_path, **synthesis.arrays())
        clean = audit(clean_path, backend=backend, compat=compat, max_findings=0)
        for kind, count in DEMO_FAULTS:
            synthesis.inject(kind, count)
        save(faulty_path, **synthesis.arrays())
        faulty_dump = load(faulty_path)
        faulty = audit(faulty_dump, backend=backend, compat=compat, max_findings=0)
        outcomes = score(faults_from_dump(faulty_dump), faulty)
    rows = {}
    for outcome in outcomes:
        row = rows.setdefault(outcome.kind, KindRow(outcome.kind))
        row.injected += 1
        if outcome.detected:
            row.detected += 1
            row.fired.update(reason_labels(outcome.fired_bits))
        elif not outcome.visible:
            row.invisible += 1
            row.notes.append(outcome.note)
        else:
            row.missed += 1
            row.fired.update(reason_labels(outcome.fired_bits))
            row.notes.append("MISSED: " + (outcome.note or "no finding at the target entry"))
    return DemoReport(synthesis=synthesis, clean=clean, faulty=faulty, outcomes=outcomes,
                      rows=[rows[k] for k in FAULT_KINDS if k in rows],
                      kept=(clean_path, faulty_path) if workdir else ())


def group_notes(notes) -> list:
    counts = defaultdict(int)
    for note in notes:
        counts[note] += 1
    return [f"{n} {note}" if n > 1 else note for note, n in counts.items()]
