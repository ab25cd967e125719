"""The data a launch reads and writes: ``types`` (the launch context, the violation log, and
the plans and real-KV sources it re-exports), ``plans``, ``sources``, and the array plumbing
under them (``arrays``: which library an array is, the argument checks; ``dlpack``: foreign
arrays without their library).

What it may import: README.md beside this file."""
