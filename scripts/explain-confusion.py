#!/usr/bin/env python3
"""Measure how often the audit's explanation names an injected fault's true cause: a
confusion table of fault kind against the diagnosed cause, over the findings at each fault's
sites (the verify entries it changed), on seeded campaign-style workloads.

    python scripts/explain-confusion.py --runs 8 --seed 0 [--layout per-token|paged] [--markdown]

Workloads are drawn with the campaign's own samplers (the ``sample_config`` of
``kvcanary.campaign.layouts.PER_TOKEN`` and ``PAGED``); every fault kind is injected at every
target class it reaches, in both layouts, audited with kvcanary's rules on the numpy backend, and every finding at a site where the fault must fire is counted under the
cause its diagnosis names. Interacting pairs are not injected here.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict

import numpy as np

from kvcanary.audit import audit
from kvcanary.dump import load, save
from kvcanary.campaign.layouts import PAGED, PER_TOKEN
from kvcanary.synth import (MODES, SynthConfig, SynthError, Synthesis, fault_kinds,
                            faults_from_dump, inapplicable_kinds)
from kvcanary.synth.fault_kinds import kind_targets

# The cause an explanation must name for each fault kind.
TRUE_CAUSE = {
    "token": "wrong-token",
    "position": "position-changed",
    "prev-hash": "link-changed",
    "real-kv-byte": "kv-bytes-changed",
    "alias": "shared-slot",
    "swap": "shifted-mapping",
    "stale-reuse": "overwritten",
    "slot-zero": "slot-zero",
    "lost-write": "never-written",
    "evicted-block": "overwritten",
}
PER_INJECTION = 4


def site_findings(fault, result) -> list:
    """The findings at each site of ``fault`` where it must fire (paged faults, which carry
    no sites: at the target entry, and a swap's other entry)."""
    if fault.sites:
        found = []
        for site in fault.sites:
            if not site.bits:
                continue
            found.extend(f for f in result.findings
                         if f.kind == site.entry and f.position == site.position
                         and f.violation.slot_idx == site.slot
                         and (site.entry == "sweep" or f.request_row == site.request_row))
        return found
    positions = [fault.position] + ([fault.detail] if fault.kind == "swap" else [])
    return [f for p in positions for f in result.findings_at(fault.request_row, p)]


def run_one(index: int, seed: int, layout: str, counts: dict, misses: list,
            scratch: str) -> None:
    rng = np.random.default_rng([seed, index])
    mode = str(rng.choice(MODES))
    config = (PAGED if layout == "paged" else PER_TOKEN).sample_config(rng, mode)
    synth_config = SynthConfig(**config)
    clean = Synthesis(synth_config).run()
    skip = inapplicable_kinds(synth_config)
    for kind in fault_kinds(synth_config.paged):
        if kind in skip:
            continue
        for target in kind_targets(kind):
            synthesis = copy.deepcopy(clean)
            try:
                made = synthesis.inject_up_to(kind, PER_INJECTION, target)
            except SynthError:
                made = []
            if not made:
                continue
            path = save(os.path.join(scratch, "d.npz"), **synthesis.arrays())
            d = load(path)
            result = audit(d, backend="numpy", max_findings=0)
            for fault in faults_from_dump(d):
                if not fault.visible:
                    continue
                found = site_findings(fault, result)
                for f in found:
                    counts[kind][f.diagnosis.cause] += 1
                    counts[kind]["(named or alternative)"] += (
                        TRUE_CAUSE[kind] in (f.diagnosis.cause, *f.diagnosis.alternatives))
                    if f.diagnosis.cause != TRUE_CAUSE[kind]:
                        misses.append((kind, fault.target, f.kind, f.diagnosis.cause,
                                       f.diagnosis.certain))
                counts[kind]["(faults)"] += 1
                counts[kind]["(faults named)"] += bool(found) and all(
                    f.diagnosis.cause == TRUE_CAUSE[kind] for f in found)


def table(counts: dict) -> list:
    lines = ["| fault kind | true cause | findings at its sites | naming it | share | also as an "
             "alternative | faults wholly named | other causes named |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind, by_cause in counts.items():
        findings = sum(c for cause, c in by_cause.items() if not cause.startswith("("))
        named = by_cause.get(TRUE_CAUSE[kind], 0)
        others = ", ".join(f"{cause} {c}" for cause, c in by_cause.most_common()
                           if cause != TRUE_CAUSE[kind] and not cause.startswith("("))
        share = f"{100 * named / findings:.1f}%" if findings else "-"
        faults = by_cause["(faults)"]
        either = by_cause["(named or alternative)"]
        either_share = f"{100 * either / findings:.1f}%" if findings else "-"
        lines.append(f"| {kind} | `{TRUE_CAUSE[kind]}` | {findings} | {named} | {share} | "
                     f"{either_share} | {by_cause['(faults named)']}/{faults} | "
                     f"{others or '-'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=("per-token", "paged"), default="per-token")
    args = parser.parse_args()
    counts: dict = defaultdict(Counter)
    misses: list = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.runs):
            run_one(index, args.seed, args.layout, counts, misses, scratch)
            print(f"run {index + 1}/{args.runs} done ({time.perf_counter() - started:.0f}s)",
                  file=sys.stderr)
    print(f"{args.layout} layout, {args.runs} runs, seed {args.seed}, "
          f"{time.perf_counter() - started:.0f}s")
    print("\n".join(table(counts)))
    print()
    print("findings not naming the true cause (kind, target class, entry, named cause, "
          "certain): count")
    for miss, count in Counter(misses).most_common():
        print(f"- {miss}: {count}")


if __name__ == "__main__":
    main()
