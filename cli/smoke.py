"""``kvcanary smoke``: the GPU smoke test (the work lives in ``kvcanary.smoke``)."""

from __future__ import annotations

import sys

import click


@click.command()
@click.option("--max-real-kv-sources", "max_real_kv_sources", type=click.IntRange(1, 64),
              default=4, show_default=True,
              help="Source-count bound to compile the kernels for; the synthetic batch uses "
                   "that many real-KV sources.")
def smoke(max_real_kv_sources: int) -> None:
    """Compile the CUDA kernels, run a synthetic batch on the GPU and with numpy, compare
    bytes and check injected faults are reported. Exit 0 on success, 1 on a mismatch or a
    missed fault, 2 when no GPU or cupy is available."""
    from kvcanary.cuda import CudaUnavailable
    from kvcanary.smoke import run_smoke

    try:
        report = run_smoke(max_real_kv_sources)
    except CudaUnavailable as exc:
        message = str(exc).removeprefix("kv-canary: ")
        click.echo(f"kvcanary smoke needs a CUDA GPU with cupy: {message}.", err=True)
        sys.exit(2)
    for line in report.lines():
        click.echo(line)
    sys.exit(0 if report.ok else 1)
