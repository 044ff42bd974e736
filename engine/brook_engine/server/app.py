"""The ASGI app: the OpenAI routes (``openai_routes``), the probes and metrics
(``probe_routes``), errors in the OpenAI shape, and loading the model in the background so
/health answers while weights load.

/health: the process is up (and its engine thread, once started, is alive).
/ready: the model is loaded and warmed up, and the server is not draining.
/metrics: Prometheus text. The API and /v1/models need the API key when one is configured;
probes do not (the kubelet does not carry it), nor metrics unless
``server.metricsRequireApiKey``. API calls beyond ``server.maxConcurrentRequests`` get 503.

A shutdown while the model loads stops the load at its next step (between building the
engine and warming it up) and waits for the loading thread, so the process never exits
with native code still running on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Lifespan

from brook_engine import __version__
from brook_engine.config import EngineConfig
from brook_engine.core.async_engine import AsyncEngine
from brook_engine.core.llm_engine import LLMEngine
from brook_engine.core.ranks import GroupSpec
from brook_engine.metrics.prometheus import EngineMetrics
from brook_engine.models.arch import resolve_model_folder
from brook_engine.server.auth import ApiKey
from brook_engine.server.errors import APIError
from brook_engine.server.limits import ConcurrencyLimit
from brook_engine.server.openai_routes import openai_routes
from brook_engine.server.probe_routes import metrics_route, probe_routes
from brook_engine.server.state import ServerState

__all__ = ["build_app", "served_name"]

log = logging.getLogger(__name__)


class _LoadStopped(Exception):
    """The server began shutting down while the model was loading."""


def served_name(config: EngineConfig) -> str:
    return config.model.served_name or resolve_model_folder(config.model).name


def build_app(
    config: EngineConfig,
    registry: CollectorRegistry | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    group: GroupSpec | None = None,
) -> Starlette:
    """The server for ``config``. The model loads when the app starts (its lifespan);
    ``on_fatal`` is told if loading fails."""
    api_key = ApiKey(config.server.api_key)
    registry = registry if registry is not None else CollectorRegistry()
    state = ServerState(served_name(config))
    routes = [*probe_routes(state), *openai_routes(state, api_key, config.server)]
    if config.server.metrics:
        guarded = config.server.metrics_require_api_key and api_key.is_set
        routes.append(metrics_route(registry, api_key.authorize if guarded else None))
    app = Starlette(
        routes=routes,
        middleware=[Middleware(ConcurrencyLimit, limit=config.server.max_concurrent_requests)],
        lifespan=_lifespan(config, state, registry, on_fatal, group),
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
    )
    app.state.brook = state
    return app


def _lifespan(
    config: EngineConfig,
    state: ServerState,
    registry: CollectorRegistry,
    on_fatal: Callable[[BaseException], None] | None,
    group: GroupSpec | None,
) -> Lifespan[Starlette]:
    """Load the model in the background while the server starts; at exit stop the load (at
    its next step, waiting for it up to the drain timeout) or the engine, and its thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loader = asyncio.ensure_future(_load(config, state, registry, on_fatal, group))
        try:
            yield
        finally:
            state.is_draining = True  # a load still running stops at its next step
            if not loader.done():
                timeout = config.server.drain_timeout_seconds
                try:
                    await asyncio.wait_for(asyncio.shield(loader), timeout)
                except TimeoutError:
                    log.warning("the model load did not stop within %.0f s", timeout)
                    loader.cancel()  # the engine, if it is ever built, stops at once
            if state.engine is not None:
                await state.engine.stop()
            thread = state.engine_thread
            if thread is not None and loader.done() and not loader.cancelled():
                await asyncio.to_thread(thread.join, 10)

    return lifespan


async def _load(
    config: EngineConfig,
    state: ServerState,
    registry: CollectorRegistry,
    on_fatal: Callable[[BaseException], None] | None,
    group: GroupSpec | None,
) -> None:
    def check_stop() -> None:
        if state.is_draining:
            raise _LoadStopped

    try:
        warm_up_s = 0.0

        def build() -> tuple[LLMEngine, EngineMetrics]:  # on the engine thread
            nonlocal warm_up_s
            state.engine_thread = threading.current_thread()
            check_stop()
            engine = LLMEngine(config, group=group)
            try:
                check_stop()
                warm_up_s = engine.warm_up()
                return engine, EngineMetrics(registry, _info(config, engine))
            except BaseException:
                engine.shutdown()
                raise

        state.engine = await AsyncEngine.launch(build, on_fatal, config.server.stream_stall_seconds)
        check_stop()
        engine = state.engine.engine
        state.tokenizer = engine.tokenizer
        state.max_model_len = engine.max_model_len
        state.vocab_size = engine.arch.vocab_size
        state.is_ready = True
        log.info("ready: %s (warm-up %.2f s)", state.served_name, warm_up_s)
    except _LoadStopped:
        log.info("model load stopped: the server is shutting down")
    except Exception as exc:
        log.error("the model failed to load: %s", exc)
        if on_fatal is not None:
            on_fatal(exc)


def _info(config: EngineConfig, engine: LLMEngine) -> dict[str, str]:
    return {
        "model": engine.served_name,
        "version": __version__,
        "device": engine.backend.kind,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "tensor_parallel": str(config.parallel.tensor),
        "pipeline_parallel": str(config.parallel.pipeline),
        "max_model_len": str(engine.max_model_len),
        "kv_block_size": str(config.kv_cache.block_size),
        "max_num_seqs": str(config.scheduler.max_num_seqs),
        "max_num_batched_tokens": str(config.scheduler.max_num_batched_tokens),
    }


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.url.path}; see /v1/completions, /v1/chat/completions"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, code=None).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return APIError(500, "internal server error; see the server log", code="internal").response()
