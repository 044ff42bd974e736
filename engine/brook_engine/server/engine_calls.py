"""From an API request to the engine and back: ids, sampling parameters, the context-length
check, submitting a call's requests, running them to the end while watching the client, and
engine failures as API errors."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from starlette.requests import Request

from brook_engine.core.async_engine import EngineStepError, EngineStoppedError
from brook_engine.core.output_stream import ClientStalledError, OutputStream, RequestFailedError
from brook_engine.core.requests import RequestError
from brook_engine.core.scheduler import QueueFullError
from brook_engine.outputs import RequestOutput
from brook_engine.sampling_params import SamplingError, SamplingParams
from brook_engine.server.errors import APIError, invalid, unavailable
from brook_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from brook_engine.server.state import ServerState


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    try:
        return SamplingParams.from_dict(
            {
                "max_tokens": max_tokens,
                "min_tokens": min(req.min_tokens, max_tokens),
                "temperature": req.temperature,
                "top_p": req.top_p,
                "top_k": max(req.top_k, 0),
                "seed": req.seed,
                "stop": tuple(req.stop_list),
                "stop_token_ids": tuple(req.stop_token_ids or ()),
                "ignore_eos": req.ignore_eos,
                "logprobs": logprobs,
                "skip_special_tokens": req.skip_special_tokens,
                "cache_salt": req.cache_salt,
            }
        )
    except SamplingError as exc:
        raise invalid(str(exc), None) from None


def check_context(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_param: str
) -> int:
    """The max_tokens to use; 400 when the prompt, or prompt plus max_tokens, is too long.
    Without max_tokens, the rest of the context."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens and the prompt "
            f"has {num_prompt_tokens}, leaving no room to generate; shorten the prompt",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} and max_tokens asks for {max_tokens}; lower max_tokens to "
            f"at most {room} or shorten the prompt",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


async def submit(state: ServerState, requests: list[Any], arrival: float) -> OutputStream:
    """Hand a call's requests to the engine; engine refusals become API errors."""
    assert state.engine is not None
    try:
        return await state.engine.add(requests, arrival)
    except QueueFullError as exc:
        # Retry-After: when the queue seen now has entered the batch (the engine's estimate),
        # so a client backs off that long and a router can send the work elsewhere.
        retry = {"Retry-After": str(exc.retry_after_seconds)}
        raise APIError(429, str(exc), code="queue_full", headers=retry) from None
    except RequestError as exc:
        raise invalid(str(exc), None) from None
    except EngineStoppedError as exc:
        raise unavailable(str(exc)) from None


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(stream: OutputStream, request: Request) -> dict[int, RequestOutput]:
    """Run every choice to its end; the client leaving aborts them all."""
    final: dict[int, RequestOutput] = {}

    async def consume() -> None:
        async for index, output in stream:
            final[index] = output

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            stream.close()
    if consumer.cancelled():
        raise ClientGone
    engine_failure(consumer.exception())
    return final


def engine_failure(exc: BaseException | None) -> None:
    """Re-raise what ended a stream as an API error."""
    if exc is None:
        return
    if isinstance(exc, EngineStoppedError):
        raise unavailable(str(exc))
    if isinstance(exc, EngineStepError):
        raise APIError(500, str(exc), code="engine_error")
    if isinstance(exc, RequestFailedError):
        raise APIError(500, str(exc), code="request_failed")
    if isinstance(exc, ClientStalledError):
        raise APIError(408, str(exc), code="client_stalled")
    raise exc
