"""The backends that run a launch: ``reference`` (the numpy reference, one small function
per rule), ``cuda`` (the CUDA kernels of ``kernels/``, compiled at run time by CuPy), where
those kernels' sources live (``kernel_source``), and the one resolution of a backend name
(``resolve``: ``auto``, ``numpy``, ``cupy``).

It may import :mod:`kvcanary.format`, :mod:`kvcanary.model` and :mod:`kvcanary.system`."""
