"""``kvcanary synth OUT``: a synthetic serving workload as a dump, optionally with faults."""

from __future__ import annotations

import os
from collections import Counter

import click

from kvcanary.audit import DEFAULT_MAX_FINDINGS
from kvcanary.backends.resolve import LIBRARIES
from kvcanary.synth import MODES

from .common import SEED_RANGE, Progress, error_boundary, fail
from .interrupt import unwritten


def _range(text: str, name: str) -> tuple:
    low, sep, high = text.partition("..")
    try:
        values = (int(low), int(high if sep else low))
    except ValueError:
        raise click.BadParameter(f"expected MIN..MAX or N, got {text!r}", param_hint=name) from None
    return values


def synth_options(function):
    """The workload options, shared with ``demo``."""
    options = [
        click.option("--requests", type=int, default=64, show_default=True,
                     help="Requests to serve."),
        click.option("--slots", "num_slots", type=int, default=4096, show_default=True,
                     help="KV slots in the pool (slot 0 is padding)."),
        click.option("--max-running", type=int, default=16, show_default=True,
                     help="Requests running at once (the live requests of the dump)."),
        click.option("--page-size", type=int, default=1, show_default=True),
        click.option("--block-size", type=int, default=0, show_default=True,
                     help="Simulate a paged engine with blocks of N slots (its pages) and "
                          "dump a block table; 0: a per-token req_to_token table."),
        click.option("--swa-window", type=int, default=0, show_default=True,
                     help="Sliding window; > 0 dumps the SWA group (slots through the LUT)."),
        click.option("--sources", type=int, default=1, show_default=True,
                     help="Real-KV sources (0..64)."),
        click.option("--bytes-per-token", type=int, default=32, show_default=True,
                     help="Real-KV bytes per slot and source (multiple of 16)."),
        click.option("--chunk-size", type=int, default=64, show_default=True,
                     help="Chunked prefill: prompt tokens per request per step."),
        click.option("--prompt-len", default="8..96", show_default=True,
                     help="Unique prompt tokens per request, MIN..MAX."),
        click.option("--output-len", default="4..32", show_default=True,
                     help="Decode tokens per request, MIN..MAX."),
        click.option("--verify-every", type=int, default=8, show_default=True,
                     help="Run verify every N steps during the simulation (0: never)."),
        click.option("--seed", type=SEED_RANGE, default=0, show_default=True),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def make_config(mode: str, **values):
    from kvcanary.synth import SynthConfig

    values["prompt_len"] = _range(values["prompt_len"], "--prompt-len")
    values["output_len"] = _range(values["output_len"], "--output-len")
    return SynthConfig(mode=mode, **values)


def check_out(out: str, force: bool) -> None:
    """Refuse to overwrite an existing file or to write into a non-empty directory unless
    ``--force`` is given."""
    target = out.rstrip("/") or out
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):   # found now, not after the whole simulation
        fail(f"OUT {out}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        fail(f"OUT {out}: the folder {folder} is not writable")
    if os.path.isdir(target):
        if os.listdir(target) and not force:
            fail(f"OUT {out}: the directory is not empty; pass --force to replace the dump "
                 "in it")
    elif os.path.exists(target) and not force:
        fail(f"OUT {out}: the file exists; pass --force to overwrite it")


@click.command("synth")
@click.argument("out", metavar="OUT")
@synth_options
@click.option("--mode", type=click.Choice(MODES), default="all",
              show_default=True, help="Real-KV hash mode.")
@click.option("--backend", type=click.Choice(LIBRARIES), default="numpy",
              show_default=True,
              help="Backend of every plan/write/verify launch (cupy moves the arrays per "
                   "launch: keep such runs small).")
@click.option("--inject", multiple=True, metavar="KIND[:COUNT][@CLASS]",
              help="Inject a fault after the run (repeatable; KIND 'all' for every kind that "
                   "applies): token, position, prev-hash, real-kv-byte, alias, swap, "
                    "stale-reuse, slot-zero, lost-write; with --block-size also evicted-block; "
                    "at target CLASS (default interior; per-token layout only): head, "
                    "interior, last, chunk-boundary, window-head, shared, cached; or "
                    "KIND+KIND:PAIRS@shared-block|chain-seam for interacting pairs.")
@click.option("--max-listed", type=click.IntRange(min=0), default=DEFAULT_MAX_FINDINGS,
              show_default=True,
              help="Injected faults listed one per line (0: all); the dump records every one.")
@click.option("--force", is_flag=True,
              help="Overwrite an existing OUT file, or replace the dump in an OUT directory.")
def synth_command(out, mode, backend, inject, max_listed, force, **values):
    """Simulate serving and write the canary dump OUT: a .npz or .safetensors file, or a
    directory of .npy files when OUT has no suffix or ends in /."""
    from kvcanary import dump
    from kvcanary.synth import Synthesis, inapplicable_kinds, parse_inject

    with error_boundary(), unwritten(out):
        config = make_config(mode, backend=backend, **values)
        container = dump.container_for(out)   # fails before the run: bad suffix, no package
        check_out(out, force)
        if backend == "cupy":
            from kvcanary.backends.cuda import require_cupy

            require_cupy()   # a clear error when cupy or a device is missing
        faults = parse_inject(inject, config)
        skipped = inapplicable_kinds(config) if any(
            spec.partition("@")[0].partition(":")[0].strip() == "all" for spec in inject) else {}
        synthesis = Synthesis(config)
        progress = Progress("synth: requests admitted and prefilled")
        try:
            synthesis.run(progress=progress)
        finally:
            progress.close()
        for kind, count, target in faults:
            synthesis.inject(kind, count, target)
        written = dump.save(out, **synthesis.arrays())
    s = synthesis.stats
    rows, seq_lens = synthesis.live()
    where = "directory" if container == "dir" else f"{container} file"
    click.echo(f"wrote {os.path.abspath(written)} ({where}): {synthesis.num_canary_slots} slots, "
               f"{rows.shape[0]} live requests ({int(seq_lens.sum())} prefix tokens), "
               f"{len(synthesis.cache)} cached blocks, {config.sources} real-KV source(s) in "
               f"{config.mode} mode" + (f", SWA window {config.swa_window}"
                                        if config.swa_window else "")
               + (f", block table of {config.block_size}-slot blocks" if config.paged else ""))
    click.echo(f"simulation: {s.steps} steps, {s.tokens_written} tokens written, "
               f"{s.cached_tokens_reused} reused from the prefix cache, {s.blocks_evicted} "
               f"blocks evicted, {s.slots_reused} slot reuses, {s.verify_launches} verify "
               f"launches clean, {s.elapsed_s:.2f}s")
    for kind, reason in skipped.items():
        click.echo(f"--inject all: skipped {kind}: {reason}")
    faults = synthesis.faults
    listed = faults if max_listed == 0 else faults[:max_listed]
    if listed:   # one write: thousands of faults are thousands of lines
        click.echo("\n".join(
            f"injected {fault.kind} at {fault.target}: {_where(fault)}, "
            f"position {fault.position}, slot {fault.slot}"
            + (f" ({fault.note})" if fault.note else "") for fault in listed))
    if len(listed) < len(faults):
        kinds = Counter(fault.kind for fault in faults)
        click.echo(f"injected faults: the first {len(listed)} of {len(faults)} are listed "
                   f"({', '.join(f'{kind} {n}' for kind, n in kinds.items())}); the dump's "
                   "synth_fault_* keys hold every one (--max-listed 0 lists all)")


def _where(fault) -> str:
    """Where a fault landed: its request row, or the sweep for a slot no live request maps."""
    if fault.request_row >= 0:
        return f"request row {fault.request_row}"
    return "a prefix-cache sweep entry (no live request maps it)"
