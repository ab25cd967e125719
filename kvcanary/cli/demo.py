"""``kvcanary demo``: prove the audit catches what it claims, on a synthetic workload."""

from __future__ import annotations

import os
import sys

import click

from kvcanary.backends.resolve import BACKENDS
from kvcanary.synth import MODES
from kvcanary.format.violations import reason_labels

from .common import (EXIT_CLEAN, EXIT_ERROR, EXIT_VIOLATIONS, SEED_RANGE, Progress,
                     error_boundary, fail)


@click.command("demo")
@click.option("--mode", type=click.Choice(MODES), default="all", show_default=True,
              help="Real-KV hash mode of the workload (partial: one real-KV byte fault is "
                   "listed as not visible).")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True)
@click.option("--seed", type=SEED_RANGE, default=0, show_default=True)
@click.option("--keep", type=click.Path(file_okay=False), default=None,
              help="Keep the clean and faulty dumps in this directory.")
@click.option("--force", is_flag=True,
              help="With --keep: overwrite clean.npz and faulty.npz already in the directory.")
@click.option("--compat", is_flag=True, help="Audit with upstream's rules only.")
@click.option("--engine", type=click.Choice(["transformers"]), default=None,
              help="Guard a real engine instead: a tiny random Llama generates through "
                   "transformers' continuous batching, clean and with a fault injected into "
                   "the engine (needs kvcanary[transformers]).")
def demo_command(mode, backend, seed, keep, force, compat, engine):
    """Synthesise a workload, audit it clean, inject every fault kind, audit again.

    Exit 0 only when the clean audit has no violation and every fault the canary can see in
    this mode was detected; faults it cannot see are listed as such. With --engine, exit 0
    when the clean run has no finding and the injected fault is found at its request."""
    if engine is not None:
        _engine_demo(engine, seed)
    from kvcanary.tools.demo import DEMO_CONFIG, KEPT_DUMPS, group_notes, run_demo

    for name in KEPT_DUMPS if keep and not force else ():
        if os.path.lexists(os.path.join(keep, name)):
            fail(f"--keep {keep}: {name} exists there; pass --force to overwrite it")
    c = DEMO_CONFIG
    click.echo(f"kvcanary demo: {c['requests']} requests over {c['num_slots']} slots, "
               f"{c['sources']} real-KV sources of {c['bytes_per_token']} bytes per token in "
               f"{mode} mode, seed {seed}")
    with error_boundary():
        progress = Progress("synth: requests admitted and prefilled")
        try:
            report = run_demo(mode=mode, seed=seed, backend=backend, workdir=keep,
                              compat=compat, progress=progress)
        finally:
            progress.close()
    s, clean, faulty = report.synthesis.stats, report.clean, report.faulty
    click.echo(f"simulation: {s.steps} steps, {s.tokens_written} tokens written, "
               f"{s.cached_tokens_reused} reused from the prefix cache, {s.blocks_evicted} blocks "
               f"evicted, {s.slots_reused} slot reuses (backend {clean.backend})")
    click.echo(f"clean audit:  {clean.entries_checked} entries checked, "
               f"{clean.total_violations} violation(s) -> {'clean' if clean.clean else 'NOT CLEAN'}")
    click.echo(f"faulty audit: {faulty.entries_checked} entries checked, "
               f"{faulty.total_violations} violation(s)")
    click.echo("")
    header = f"{'fault kind':<14}{'injected':>9}{'detected':>10}  {'check that fired':<48}note"
    click.echo(header)
    click.echo("-" * len(header))
    for row in report.rows:
        fired = "+".join(sorted(row.fired)) or "-"
        notes = "; ".join(group_notes(row.notes))
        click.echo(f"{row.kind:<14}{row.injected:>9}{row.detected:>10}  {fired:<48}{notes}")
    click.echo("")
    example = report.example()
    if example is not None:
        checks = "+".join(reason_labels(example.violation.fail_reason_bits))
        click.echo(f"what a finding looks like ({checks} at an injected fault):")
        click.echo(example.violation.log_line())
        click.echo(f"  at: {example.where()}")
        click.echo(f"  likely cause: {example.cause}")
        click.echo(f"{faulty.total_violations} violation(s) from {report.faults} fault(s): a "
                   "changed token or position also breaks the chain link of the next token, "
                   "whose stored prev-hash was computed from the record as it was written, so "
                   "the next position is flagged too.")
        click.echo("")
    for path in report.kept:
        click.echo(f"kept {os.path.abspath(path)}")
    invisible = sum(row.invisible for row in report.rows)
    missed = sum(row.missed for row in report.rows)
    if report.passed:
        extra = (f"; {invisible} fault(s) not visible in this configuration, listed above"
                 if invisible else "")
        click.echo(f"PASS: the clean workload audits clean and every fault the canary can see "
                   f"was detected{extra}")
        sys.exit(EXIT_CLEAN)
    reasons = []
    if not clean.clean:
        reasons.append(f"the clean workload has {clean.total_violations} violation(s)")
    if missed:
        reasons.append(f"{missed} visible fault(s) were not detected")
    click.echo("FAIL: " + "; ".join(reasons))
    sys.exit(EXIT_VIOLATIONS)


def _engine_demo(engine: str, seed: int) -> None:
    from kvcanary.tools.demo import run_engine_demo

    try:
        report = run_engine_demo(engine, seed=seed)
    except ImportError as exc:
        click.echo(f"kvcanary demo --engine {engine}: needs torch and transformers "
                   f"(pip install 'kvcanary[transformers]'): {exc}", err=True)
        sys.exit(EXIT_ERROR)
    clean, faulty = report.clean, report.faulty
    click.echo(f"kvcanary demo --engine {engine}: a tiny random Llama generating through "
               "continuous batching, guarded by kvcanary")
    click.echo(f"clean run:  {clean['steps']} steps, {clean['entries_verified']} entries "
               f"verified, {clean['tokens_written']} tokens written, {clean['findings']} "
               "finding(s)")
    click.echo(f"fault:      {report.fault}")
    click.echo(f"faulty run: {faulty['steps']} steps, {faulty['findings']} finding(s)")
    hits = report.hits()
    if hits:
        click.echo("")
        click.echo("what the guard found at the fault:")
        click.echo(hits[0].describe())
        click.echo("")
    if report.passed:
        click.echo("PASS: the clean run has no finding and the fault was found at its request")
        sys.exit(EXIT_CLEAN)
    click.echo("FAIL: " + ("the clean run has findings" if clean["findings"] else
                           "the injected fault was not found at its request"))
    sys.exit(EXIT_VIOLATIONS)
