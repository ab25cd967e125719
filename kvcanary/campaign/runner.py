"""The campaign runner: the clean runs, then rounds of fault runs planned from the remaining
deficits, on a worker pool; every run audited on every backend under both rule sets and
scored into the report's cells. What a layout changes comes from its
:class:`~kvcanary.campaign.layouts.Layout`."""

from __future__ import annotations

import copy
import multiprocessing
import os
import platform
import time
from collections import Counter

import numpy as np

from ..audit import audit
from ..backends.resolve import cupy_unavailable, resolve_backend
from ..system.signals import WorkerPool
from ..synth import MODES, SynthConfig, SynthError, Synthesis, faults_from_dump, score
from ..synth.fault_kinds import PAIR_SHAPES
from ..format.violations import reason_labels
from .layouts import LAYOUTS, RULES, audit_command, designed, fault_scope, synth_command
from .model import CLEAN_RUN_ATTEMPTS, MAX_REPORTED, CampaignError, CampaignReport, Cell

MAX_ROUNDS = 200
DEFAULT_FAULTS_PER_KIND = 1000
DEFAULT_CLEAN_RUNS = 200


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
    for backend, rules, result in _audits(synthesis.dump(), backends):
        key = "|".join((phase, backend, rules))
        audits, violations = out["fp"].get(key, (0, 0))
        out["fp"][key] = (audits + 1, violations + result.total_violations)
        if result.total_violations:
            out["false_positives"].append(
                _false_positive(what, config, backend, rules, result))


def _simulate(out: dict, config):
    """Play ``config``; None when it failed (recorded as an error: an honest run whose in-run
    verify fired)."""
    try:
        return Synthesis(SynthConfig(**config)).run()
    except SynthError as exc:
        out["errors"].append({"what": f"simulation failed: {str(exc).splitlines()[0]}",
                              "config": config, "reproduce": synth_command(config)})
        return None


def target_census(synthesis, targets) -> dict:
    """Target class -> verify entries of that class in a synthesis's state."""
    masks = synthesis.injector.entries().masks
    return {target: int(masks[target].sum()) for target in targets}


def run_fault_task(task: dict) -> dict:
    """One fault run: play the workload, audit its clean state, then run each injection of
    the plan on a copy of it and score its faults; runs in a worker process too."""
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
    d = synthesis.dump()
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


def clean_run_config(seed: int, index: int, attempt: int, layout: str = "per-token") -> dict:
    rng = np.random.default_rng([seed, 1, index, attempt])
    return LAYOUTS[layout].sample_config(rng, MODES[int(rng.integers(len(MODES)))], clean=True)


def run_clean_task(task: dict) -> dict:
    """One clean run: the first sampled workload whose final state holds every class of the
    layout's ``clean_classes`` (or the last attempt, flagged), audited without faults."""
    out = {"index": task["index"], "fp": {}, "false_positives": [], "errors": [],
           "replaced": 0, "census": {}, "missing": []}
    form = LAYOUTS[task.get("layout", "per-token")]
    census = missing = ()
    for attempt in range(CLEAN_RUN_ATTEMPTS):
        config = clean_run_config(task["seed"], task["index"], attempt, form.name)
        synthesis = _simulate(out, config)
        if synthesis is None:
            return out
        if not form.clean_classes:
            break
        census = target_census(synthesis, form.targets)
        missing = [t for t in form.clean_classes if not census[t]]
        if not missing or attempt == CLEAN_RUN_ATTEMPTS - 1:
            break
        out["replaced"] += 1
    out["census"], out["missing"] = dict(census), list(missing)
    _audit_clean(out, config, synthesis, task["backends"], "clean", "clean run")
    return out


def resolve_backends(name: str):
    """``(backends that run, {backend not run: why})`` for ``auto``, ``numpy`` or ``cupy``:
    ``auto`` runs both where a CUDA device is usable."""
    try:
        chosen = resolve_backend(name)
    except ValueError as exc:   # the option's name leads, as in the other option errors
        raise CampaignError("--" + getattr(exc, "detail", str(exc))) from None
    if name == "auto":
        return (["numpy", "cupy"], {}) if chosen == "cupy" else (["numpy"], {"cupy": cupy_unavailable()})
    other = "cupy" if chosen == "numpy" else "numpy"
    return [chosen], {other: f"not requested (--backend {chosen})"}


def machine_description() -> str:
    return f"{os.cpu_count()}-core {platform.machine()}, {platform.system()}"


def _worker_pool(jobs: int, cuda: bool) -> WorkerPool:
    # fork is cheaper, but a forked child would inherit a CUDA context it cannot use
    method = "spawn" if cuda or "fork" not in multiprocessing.get_all_start_methods() else "fork"
    return WorkerPool(jobs, start_method=method)


def run_campaign(*, faults_per_kind: int = DEFAULT_FAULTS_PER_KIND,
                 clean_runs: int = DEFAULT_CLEAN_RUNS, seed: int = 0,
                 backend: str = "auto", jobs: int | None = None, layout: str = "per-token",
                 progress=None) -> CampaignReport:
    """Run the campaign and return its report; ``progress(phase, done, total)`` is called as
    runs finish. ``layout`` is a name of :data:`~kvcanary.campaign.layouts.LAYOUTS`:
    ``per-token`` (``req_to_token`` tables) or ``paged`` (block tables)."""
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
    tasks = [{"index": index, "seed": report.seed, "backends": report.backends,
              **({"layout": report.layout} if report.layout != "per-token" else {})}
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
    form, target = report.form, report.faults_per_kind
    injected = Counter()     # (target class, kind, mode, scope) -> faults
    cells = form.cells()
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
            need = form.runs_needed(deficit, mode)
            for i in range(max(need.values(), default=0)):
                rng = np.random.default_rng([report.seed, 0, index])
                config = form.sample_config(rng, mode)
                tasks.append({"index": index, "config": config, "backends": report.backends,
                              "plan": form.plan(rng, config, need, i)})
                index += 1
        setting = form.mix_setting[0]
        for out in runner.map(run_fault_task, tasks):
            report.fault_runs += 1
            report.injections += len(out["injections"])
            config = tasks[out["index"] - first]["config"]
            for name in (setting, "swa_window", "sources", "bytes_per_token"):
                value = config[name] if name != "swa_window" else ("on" if config[name] else "off")
                report.mix[(name, value)] += 1
            report.add_fp(out["fp"])
            report.unattributed += out["unattributed"]
            _keep(report.false_positives, out["false_positives"])
            _keep(report.errors, out["errors"])
            report.miss_count += len(out["misses"])
            _keep(report.misses, out["misses"])
            for key, cell in out["cells"].items():
                backend, rules, *cell_key = key.split("|")
                report.cells.setdefault((backend, rules, *cell_key), Cell()).add(cell)
                if backend == report.backends[0] and rules == RULES[0]:
                    injected[tuple(cell_key)] += cell.injected
            report_fault_progress(progress, injected, cells, target)
