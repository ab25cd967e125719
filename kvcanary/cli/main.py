"""The click command group behind the ``kvcanary`` entry point: it parses arguments,
calls the library and renders; the work lives in ``kvcanary``."""

from __future__ import annotations

import click

import kvcanary

from .audit import audit_command
from .campaign import campaign_command
from .common import end_output, output_failed
from .demo import demo_command
from .explain import explain_command
from .interrupt import interruptible
from .serve import serve_command
from .smoke import smoke
from .synth import synth_command


class _Main(click.Group):
    """The command group; standard output failing ends any command the same way."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if output_failed(exc):
                end_output(exc)
            raise


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(kvcanary.__version__, prog_name="kvcanary")
def main() -> None:
    """kvcanary: catch silent KV-cache corruption with SGLang-compatible KV canaries."""


@main.command()
def info() -> None:
    """Version, hash scheme, default bound and where the kernel sources are."""
    from kvcanary.tools.info import environment_report

    for key, value in environment_report().items():
        click.echo(f"{key + ':':<22}{value}")


# The command list of ``kvcanary --help``: one whole phrase each (click would cut the first
# sentence of the docstring mid-word).
SHORT_HELP = {
    "demo": "Prove it: synthesise, audit clean, inject every fault, audit again.",
    "synth": "Simulate serving and write its canary dump, optionally with faults.",
    "audit": "Verify the canary of dumped KV caches; findings with their causes.",
    "explain": "Read SGLang's --kv-canary log (and kvcanary JSON) back as findings.",
    "campaign": "Detection coverage: thousands of faults, scored by kind and target.",
    "smoke": "Compile the CUDA kernels and cross-check them on a GPU.",
    "serve": "Serve a model with transformers' OpenAI-compatible server, guarded.",
}
info.short_help = "Versions, hash scheme, NVRTC source, GPU, kernel sources."
for _command in (demo_command, synth_command, audit_command, explain_command, campaign_command,
                 smoke):
    _command.short_help = SHORT_HELP[_command.name]
    main.add_command(interruptible(_command))
# A server's stop is SIGINT or SIGTERM: it drains and exits 0 (its own signal handling).
serve_command.short_help = SHORT_HELP[serve_command.name]
main.add_command(serve_command)
