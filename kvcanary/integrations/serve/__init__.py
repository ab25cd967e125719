"""A guarded OpenAI-compatible server: transformers' own (``transformers serve``, FastAPI and
uvicorn, continuous batching forced on) run in this process with a
:class:`~kvcanary.integrations.serve.state.ServeGuard` on every model it loads, and three
endpoints beside its own (``GET /metrics``, ``GET /kvcanary/findings``, ``GET
/kvcanary/summary``). ``kvcanary serve`` is the command; :func:`run` (:mod:`.server`) does
the work, :mod:`.state` keeps the guards, findings and metrics, :mod:`.routes` adds the
endpoints; this module re-exports the public names.

Where it hooks in, each restored when :func:`run` returns: transformers' continuous-batching
generate manager of the server (``CBGenerateManager.init_cb`` enters a guard on the model
before the engine starts, with synchronous batching, ``stop`` leaves it) and its app factory
(``build_server``: the endpoints are added to the app it returns). The server runs on its
own thread; the calling thread waits for SIGINT or SIGTERM, then lets uvicorn drain the
requests in flight, stops the engine and returns. Needs ``kvcanary[serve]``; nothing of it is
imported by ``import kvcanary``.
"""

from __future__ import annotations

from .server import run
from .state import ON_VIOLATION, ServeState

__all__ = ["ON_VIOLATION", "ServeState", "run"]
