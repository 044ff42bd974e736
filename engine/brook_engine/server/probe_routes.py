"""/health, /ready and /metrics: for kubelet and Prometheus, which carry no API key.

/health: the process is up (and its engine thread, once started, is alive).
/ready: the model is loaded and warmed up, and the server is not draining.
/metrics: Prometheus text; asks for the API key only with ``server.metricsRequireApiKey``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from brook_engine.server.state import ServerState


def probe_routes(state: ServerState) -> list[Route]:
    return [
        Route("/health", partial(health, state), methods=["GET"]),
        Route("/ready", partial(ready, state), methods=["GET"]),
    ]


def metrics_route(
    registry: CollectorRegistry, authorize: Callable[[Request], None] | None = None
) -> Route:
    """/metrics; ``authorize`` raises for a request that may not read them."""
    return Route("/metrics", partial(metrics, registry, authorize), methods=["GET"])


async def health(state: ServerState, request: Request) -> Response:
    if state.is_ready and state.engine is not None and not state.engine.is_running:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def ready(state: ServerState, request: Request) -> Response:
    if state.is_draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not state.is_ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    if state.engine is not None and not state.engine.is_running:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return JSONResponse({"status": "ready"})


async def metrics(
    registry: CollectorRegistry, authorize: Callable[[Request], None] | None, request: Request
) -> Response:
    if authorize is not None:
        authorize(request)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
