"""What completions and chat share: the server's state, sampling parameters from a request,
the context-length check, running a call's choices to the end while watching the client,
logprobs and usage in the OpenAI shape."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from brook_engine.async_engine import AsyncEngine, EngineStepError, EngineStoppedError, OutputStream
from brook_engine.llm_engine import RequestError
from brook_engine.outputs import RequestOutput
from brook_engine.sampling_params import SamplingError, SamplingParams
from brook_engine.scheduler import QueueFullError
from brook_engine.server.errors import APIError, invalid
from brook_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from brook_engine.tokenizer import Tokenizer


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


@dataclass
class ServerState:
    """What the handlers need, filled in once the model is loaded."""

    served_name: str
    engine: AsyncEngine | None = None
    tokenizer: Tokenizer | None = None
    max_model_len: int = 0
    vocab_size: int = 0
    is_ready: bool = False
    is_draining: bool = False
    num_in_flight: int = 0  # API calls between their start and their last byte
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    created: int = field(default_factory=lambda: int(time.time()))

    def begin(self) -> None:
        self.num_in_flight += 1
        self.idle.clear()

    def end(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self.idle.set()


class EventStream(StreamingResponse):
    """A server-sent-event response that runs its close callbacks however it ends: fully
    sent, client gone mid-stream, or cancelled before the first byte."""

    def __init__(self, events: AsyncIterator[str], *on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.on_close = list(on_close)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for callback in self.on_close:
                callback()


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
        raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"}) from None
    except RequestError as exc:
        raise invalid(str(exc), None) from None
    except EngineStoppedError as exc:
        raise unavailable(str(exc)) from None


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="unavailable", headers={"Retry-After": "1"})


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
    raise exc


def usage(prompt_lengths: list[int], outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(prompt_lengths)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = prompt + completion
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[tuple[float, dict[int, float]]],
    text_offset: int = 0,
) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=text_offset))
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in logprobs],
        "top_logprobs": [
            {token_text(tokenizer, t): v for t, v in top.items()} for _, top in logprobs
        ],
        "text_offset": offsets[: len(tokens)],
    }


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[tuple[float, dict[int, float]]]
) -> dict[str, Any]:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs: [...]}, ...]."""

    def entry(token_id: int, value: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(t, lp),
                "top_logprobs": [entry(alt, v) for alt, v in top.items()],
            }
            for t, (lp, top) in zip(token_ids, logprobs, strict=True)
        ]
    }


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
