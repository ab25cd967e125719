"""The backends that run a launch: ``reference`` (the numpy reference, one small function
per rule), ``cuda`` (the CUDA kernels of ``kernels/``, compiled at run time by CuPy), where
those kernels' sources live (``kernel_source``), and the one resolution of a backend name
(``resolve``: ``auto``, ``numpy``, ``cupy``).

What it may import: README.md beside this file."""
