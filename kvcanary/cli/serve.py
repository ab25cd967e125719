"""``kvcanary serve MODEL [options] [-- transformers serve options]``: transformers' own
OpenAI-compatible server in this process, every model it loads guarded."""

from __future__ import annotations

import click

from .common import ERROR_PREFIX, EXIT_ERROR, user_error


@click.command("serve")
@click.argument("model")
@click.option("--sources", type=click.Choice(["k0", "kv-all", "none"]), default="k0",
              show_default=True,
              help="Real-KV sources: k0 (layer 0's K rows), kv-all (K and V of every layer) "
                   "or none.")
@click.option("--hash-mode", type=click.Choice(["none", "partial", "all"]), default="all",
              show_default=True, help="How much of each slot's KV bytes a record fingerprints.")
@click.option("--check-tokens/--no-check-tokens", default=True, show_default=True,
              help="Verify stored token ids against each request's tokens.")
@click.option("--plan-from", type=click.Choice(["read_indices", "block_table"]),
              default="read_indices", show_default=True,
              help="Verify the slots attention gathers, or those the block table maps.")
@click.option("--on-violation", type=click.Choice(["log", "abort-request", "exit"]),
              default="log", show_default=True,
              help="On a finding: log it and go on; end the affected request with an error its "
                   "client sees; or fail the requests in flight and stop with exit 1.")
@click.option("--canary-log", type=click.Path(dir_okay=False), default=None,
              help="Append every finding to this file as a kv_canary violation block (what "
                   "kvcanary explain reads), with its request and position.")
@click.option("--drill", "drills", multiple=True, metavar="KIND@STEP",
              help="Fire drill: inject one fault (remap, free-held, kv-flip, position-shift) "
                   "into the engine at that step, to check the alert end to end. Repeatable.")
@click.argument("serve_args", nargs=-1, type=click.UNPROCESSED)
def serve_command(model, sources, hash_mode, check_tokens, plan_from, on_violation, canary_log,
                  drills, serve_args):
    """Serve MODEL with transformers' OpenAI-compatible server (continuous batching),
    guarded by kvcanary; options after `--` go to `transformers serve` (e.g. --host, --port,
    --device, --cb-block-size, --cb-num-blocks).

    SIGINT or SIGTERM stops accepting requests, lets those in flight finish and exits 0 (a
    second signal stops at once). Exit 1 when --on-violation exit stopped the server, 2 on a
    bad option or a missing package (kvcanary[serve])."""
    from kvcanary.integrations.transformers import GuardError

    try:
        from kvcanary.integrations.serve import run

        code = run(model, sources=() if sources == "none" else sources, hash_mode=hash_mode,
                   check_tokens=check_tokens, plan_from=plan_from, on_violation=on_violation,
                   canary_log=canary_log, drills=drills, serve_args=serve_args)
    except GuardError as exc:
        click.echo(f"{ERROR_PREFIX}{str(exc).removeprefix('kvcanary: ')}", err=True)
        raise SystemExit(EXIT_ERROR) from None
    except Exception as exc:
        message = user_error(exc)
        if message is None:
            raise
        click.echo(f"{ERROR_PREFIX}{message}", err=True)
        raise SystemExit(EXIT_ERROR) from None
    raise SystemExit(code)
