"""The endpoints a guarded server adds beside transformers' own: ``GET /metrics``
(Prometheus text format), ``GET /kvcanary/findings`` and ``GET /kvcanary/summary`` (JSON)."""

from __future__ import annotations

from .state import ServeState


def add_routes(app, state: ServeState) -> None:
    """Add the three endpoints to the FastAPI ``app``."""
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    @app.get("/metrics")
    def metrics():
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kvcanary/findings")
    def findings():
        return JSONResponse(state.findings_json())

    @app.get("/kvcanary/summary")
    def summary():
        return JSONResponse(state.summary())
