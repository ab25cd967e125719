"""The work behind the tool commands: ``smoke`` (the GPU smoke test), ``demo`` (the demo
and the engine demo) and ``info`` (the environment report). The commands themselves live
in :mod:`kvcanary.cli`.

What it may import: README.md beside this file."""
