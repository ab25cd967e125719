"""``kvcanary campaign``: the detection-coverage campaign (kvcanary.campaign) as a table."""

from __future__ import annotations

import json
import os
import sys

import click

from kvcanary.backends.resolve import BACKENDS
from kvcanary.campaign import DEFAULT_CLEAN_RUNS, DEFAULT_FAULTS_PER_KIND

from .common import EXIT_CLEAN, EXIT_VIOLATIONS, JOBS_RANGE, SEED_RANGE, Progress, error_boundary, fail
from .interrupt import interrupted_record, on_interrupt, unwritten


@click.command("campaign")
@click.option("--faults-per-kind", type=click.IntRange(min=1), default=DEFAULT_FAULTS_PER_KIND,
              show_default=True,
              help="Faults of every kind to inject in every hash mode (at least).")
@click.option("--clean-runs", type=click.IntRange(min=0), default=DEFAULT_CLEAN_RUNS,
              show_default=True,
              help="Randomized clean workloads audited for false positives.")
@click.option("--seed", type=SEED_RANGE, default=0, show_default=True,
              help="Campaign seed; every run is a function of it and the run's index.")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto",
              show_default=True,
              help="auto: numpy, plus cupy when a CUDA device is usable.")
@click.option("--format", "fmt", type=click.Choice(["text", "markdown", "json"]),
              default="text", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the report to this file instead of stdout.")
@click.option("-j", "--jobs", type=JOBS_RANGE, default=None,
              help="Worker processes [default: CPU count].")
@click.option("--layout", type=click.Choice(["per-token", "paged"]), default="per-token",
              show_default=True,
              help="per-token: req_to_token dumps; paged: paged engines (synth --block-size) "
                   "dumping block tables, with the paged fault forms.")
def campaign_command(faults_per_kind, clean_runs, seed, backend, fmt, out, jobs, layout):
    """Inject faults of every kind into randomized synth workloads, audit them, and report
    the detection rate per fault kind and hash mode plus false positives on clean runs.

    The default campaign (1,000 faults of every kind in every mode, 200 clean runs) takes
    about ten minutes on a 2-core machine, the paged layout about fifteen; smaller
    --faults-per-kind and --clean-runs run faster.

    Exit 0 when every fault the canary is designed to see was detected and no clean audit
    had a violation, 1 when a target was missed (each miss comes with the commands that
    reproduce it), 2 on bad input."""
    from kvcanary.system.atomic import replacing
    from kvcanary.campaign import render, run_campaign

    if out:   # fail before the campaign, not after it
        folder = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            fail(f"--out {out}: the folder {folder} does not exist or is not writable")
    bars = {}

    def progress(phase, done, total):
        if phase not in bars:   # a new phase: finish the line of the previous one
            for other in bars.values():
                other.close()
            bars.clear()
            bars[phase] = Progress(f"campaign: {phase}")
        bars[phase](done, total)

    if fmt == "json" and not out:
        on_interrupt(lambda exc: click.echo(json.dumps(interrupted_record(exc))))
    with error_boundary(), unwritten(out or "the report"):
        try:
            report = run_campaign(faults_per_kind=faults_per_kind, clean_runs=clean_runs,
                                  seed=seed, backend=backend, jobs=jobs, layout=layout,
                                  progress=progress)
        finally:
            for bar in bars.values():
                bar.close()
        text = render(report, fmt)
        if out:
            try:
                with replacing(out) as temporary, open(temporary, "w", encoding="utf-8") as handle:
                    handle.write(text)
            except OSError as exc:
                fail(f"--out {out}: {exc.strerror or exc}")
    if out:
        click.echo(f"wrote {out}: " + ("PASS" if report.passed else
                                       f"FAIL ({len(report.failures())} target(s) missed)"))
    else:
        click.echo(text, nl=False)
    sys.exit(EXIT_CLEAN if report.passed else EXIT_VIOLATIONS)
