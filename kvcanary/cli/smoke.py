"""``kvcanary smoke``: the GPU smoke test (the work lives in ``kvcanary.tools.smoke``)."""

from __future__ import annotations

import sys

import click

from kvcanary import MAX_REAL_KV_SOURCES, MAX_REAL_KV_SOURCES_LIMIT

from .common import EXIT_CLEAN, EXIT_VIOLATIONS, error_message, fail


@click.command()
@click.option("--max-real-kv-sources", "max_real_kv_sources",
              type=click.IntRange(1, MAX_REAL_KV_SOURCES_LIMIT), default=MAX_REAL_KV_SOURCES,
              show_default=True,
              help="Source-count bound to compile the kernels for; the synthetic batch uses "
                   "that many real-KV sources.")
def smoke(max_real_kv_sources: int) -> None:
    """Compile the CUDA kernels, run a synthetic batch on the GPU and with numpy, compare
    bytes and check injected faults are reported. Exit 0 on success, 1 on a mismatch or a
    missed fault, 2 when no GPU or cupy is available."""
    from kvcanary.backends.cuda import CudaUnavailable
    from kvcanary.tools.smoke import run_smoke

    try:
        report = run_smoke(max_real_kv_sources)
    except CudaUnavailable as exc:
        fail(f"smoke needs a CUDA GPU with cupy: {error_message(exc)}")
    for line in report.lines():
        click.echo(line)
    sys.exit(EXIT_CLEAN if report.ok else EXIT_VIOLATIONS)
