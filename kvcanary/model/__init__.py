"""The data a launch reads and writes: ``types`` (the launch context, the violation log, and
the plans and real-KV sources it re-exports), ``plans``, ``sources``, and the array plumbing
under them (``arrays``: which library an array is, the argument checks; ``dlpack``: foreign
arrays without their library).

It may import :mod:`kvcanary.format`."""
