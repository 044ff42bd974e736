"""The OpenAI API under /v1: the model list, completions and chat completions; all need the
API key when one is configured.

A generation call is checked in this order: API key (401), draining or still loading (503),
body size, arrival time and JSON (413, 408, 400), fields (400), model name (404). From then
until its last byte is sent it counts as in flight, which the drain on shutdown waits for.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from brook_engine.config.server import ServerOptions
from brook_engine.server.auth import ApiKey
from brook_engine.server.chat import create_chat_completion
from brook_engine.server.completions import create_completion
from brook_engine.server.engine_calls import ClientGone
from brook_engine.server.errors import (
    APIError,
    from_validation_error,
    invalid,
    nested_too_deeply,
    unavailable,
)
from brook_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from brook_engine.server.replies import EventStream
from brook_engine.server.state import ServerState

#: What /v1/completions and /v1/chat/completions run once the call has passed the checks.
Handler = Callable[[ServerState, Any, Request, float], Awaitable[Response]]


def openai_routes(state: ServerState, api_key: ApiKey, options: ServerOptions) -> list[Route]:
    api = _OpenAIApi(state, api_key, options)
    return [
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.get_model, methods=["GET"]),
        Route(
            "/v1/completions",
            api.generation(CompletionRequest, create_completion),
            methods=["POST"],
        ),
        Route(
            "/v1/chat/completions",
            api.generation(ChatCompletionRequest, create_chat_completion),
            methods=["POST"],
        ),
    ]


class _OpenAIApi:
    def __init__(self, state: ServerState, api_key: ApiKey, options: ServerOptions) -> None:
        self.state = state
        self.authorize = api_key.authorize
        self.max_body_bytes = options.max_body_bytes
        self.body_timeout = options.body_read_timeout_seconds

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.state.served_name,
            "object": "model",
            "created": self.state.created,
            "owned_by": "brook",
            "max_model_len": self.state.max_model_len or None,
        }

    async def list_models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def get_model(self, request: Request) -> Response:
        self.authorize(request)
        if request.path_params["model"] != self.state.served_name:
            raise _unknown_model(request.path_params["model"], self.state.served_name)
        return JSONResponse(self.model_card())

    def generation(
        self, model: type[BaseModel], handler: Handler
    ) -> Callable[[Request], Awaitable[Response]]:
        """The endpoint that checks a call, validates its body as ``model`` and runs
        ``handler``, counting it in flight until its response is sent."""
        state = self.state

        async def endpoint(request: Request) -> Response:
            arrival = time.monotonic()
            self.authorize(request)
            if state.is_draining:
                raise unavailable("the server is shutting down; retry on another replica")
            if not state.is_ready:
                raise unavailable("the model is still loading; retry shortly")
            body = await _json_body(request, self.max_body_bytes, self.body_timeout)
            try:
                req = model.model_validate(body)
            except ValidationError as exc:
                raise from_validation_error(exc) from None
            except RecursionError:
                raise nested_too_deeply() from None
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


def _unknown_model(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"the model {name!r} does not exist here; this server serves {served!r}",
        param="model",
        code="model_not_found",
    )


async def _json_body(request: Request, max_bytes: int, timeout: float) -> Any:
    """The body as a JSON object: 413 past ``max_bytes`` (nothing more is read), 408 when it
    has not all arrived ``timeout`` seconds after the headers, 400 when it is not JSON."""
    # The rest of the body is not read: close the connection after the answer.
    too_large = APIError(
        413,
        f"the body exceeds {max_bytes} bytes (server.maxBodyBytes)",
        code="body_too_large",
        headers={"Connection": "close"},
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    raise too_large
    except TimeoutError:
        raise APIError(
            408,
            f"the body did not arrive within {timeout:g} s (server.bodyReadTimeoutSeconds); "
            "send it at once",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    try:
        data = json.loads(body)
    except RecursionError:
        raise nested_too_deeply() from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"the body is not valid JSON: {exc}", None, code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object", None, code="invalid_json")
    return data
