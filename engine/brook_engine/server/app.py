"""The ASGI app: OpenAI routes, probes, metrics, API key, and loading the model in the
background so /health answers while weights load.

/health: the process is up (and its engine thread, once started, is alive).
/ready: the model is loaded and warmed up, and the server is not draining.
/metrics: Prometheus text. The API and /v1/models need the API key when one is configured;
probes and metrics do not (kubelet and Prometheus do not carry it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from brook_engine import __version__
from brook_engine.async_engine import AsyncEngine
from brook_engine.config import ConfigError, EngineConfig
from brook_engine.config.server import ApiKeyConfig
from brook_engine.llm_engine import LLMEngine, resolve_model_folder
from brook_engine.metrics.prometheus import EngineMetrics
from brook_engine.parallel.launch import GroupSpec
from brook_engine.server.chat import create_chat_completion
from brook_engine.server.completions import create_completion
from brook_engine.server.errors import APIError, from_validation_error, invalid
from brook_engine.server.generation import ClientGone, EventStream, ServerState, unavailable
from brook_engine.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024


def read_api_key(config: ApiKeyConfig | None) -> str | None:
    """The key from its file or environment variable; ``ConfigError`` if it is not there.
    The key is never logged."""
    if config is None:
        return None
    if config.env is not None:
        key = os.environ.get(config.env, "").strip()
        where = f"environment variable {config.env}"
    else:
        assert config.file is not None
        try:
            key = Path(config.file).read_text("utf-8").strip()
        except OSError as exc:
            raise ConfigError(
                f"server.apiKey.file: cannot read {config.file}: {exc.strerror}"
            ) from None
        where = f"file {config.file}"
    if not key:
        raise ConfigError(f"server.apiKey: the {where} is empty; put the key there")
    return key


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
    api_key = read_api_key(config.server.api_key)
    registry = registry if registry is not None else CollectorRegistry()
    state = ServerState(served_name(config))

    async def load() -> None:
        try:
            warm_up_s = 0.0

            def build() -> tuple[LLMEngine, EngineMetrics]:
                nonlocal warm_up_s
                engine = LLMEngine(config, group=group)
                warm_up_s = engine.warm_up()
                return engine, EngineMetrics(registry, _info(config, engine))

            state.engine = await AsyncEngine.launch(build, on_fatal)
            engine = state.engine.engine
            state.tokenizer = engine.tokenizer
            state.max_model_len = engine.max_model_len
            state.vocab_size = engine.arch.vocab_size
            state.is_ready = True
            log.info("ready: %s (warm-up %.2f s)", state.served_name, warm_up_s)
        except Exception as exc:
            log.error("the model failed to load: %s", exc)
            if on_fatal is not None:
                on_fatal(exc)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loader = asyncio.ensure_future(load())
        try:
            yield
        finally:
            if not loader.done():
                loader.cancel()
            if state.engine is not None:
                await state.engine.stop()

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(
                401,
                "missing or wrong API key; send it as 'Authorization: Bearer KEY'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def health(request: Request) -> Response:
        if state.is_ready and state.engine is not None and not state.engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if state.is_draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.is_ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        if state.engine is not None and not state.engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {
            "id": state.served_name,
            "object": "model",
            "created": state.created,
            "owned_by": "brook",
            "max_model_len": state.max_model_len or None,
        }

    async def list_models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def get_model(request: Request) -> Response:
        authorize(request)
        if request.path_params["model"] != state.served_name:
            raise _unknown_model(request.path_params["model"], state.served_name)
        return JSONResponse(model_card())

    def api(
        model: type[BaseModel],
        handler: Callable[[ServerState, Any, Request, float], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            arrival = time.monotonic()
            authorize(request)
            if state.is_draining:
                raise unavailable("the server is shutting down; retry on another replica")
            if not state.is_ready:
                raise unavailable("the model is still loading; retry shortly")
            body = await _json_body(request)
            try:
                req = model.model_validate(body)
            except ValidationError as exc:
                raise from_validation_error(exc) from None
            if req.model != state.served_name:  # type: ignore[attr-defined]
                raise _unknown_model(req.model, state.served_name)  # type: ignore[attr-defined]
            state.begin()
            try:
                response = await handler(state, req, request, arrival)
            except ClientGone:
                state.end()
                return Response(status_code=499)  # nobody is listening; for the access log
            except BaseException:
                state.end()
                raise
            if isinstance(response, EventStream):
                response.on_close.append(state.end)
            else:
                state.end()
            return response

        return endpoint

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", api(CompletionRequest, create_completion), methods=["POST"]),
        Route(
            "/v1/chat/completions",
            api(ChatCompletionRequest, create_chat_completion),
            methods=["POST"],
        ),
    ]
    if config.server.metrics:
        routes.append(Route("/metrics", metrics, methods=["GET"]))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
    )
    app.state.brook = state
    return app


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
    }


def _unknown_model(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"the model {name!r} does not exist here; this server serves {served!r}",
        param="model",
        code="model_not_found",
    )


async def _json_body(request: Request) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"the body is not valid JSON: {exc}", None, code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object", None, code="invalid_json")
    return data


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
