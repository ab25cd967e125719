"""The work behind the tool commands: ``smoke`` (the GPU smoke test), ``demo`` (the demo
and the engine demo) and ``info`` (the environment report). The commands themselves live
in :mod:`kvcanary.cli`.

It may import every layer but the command line."""
