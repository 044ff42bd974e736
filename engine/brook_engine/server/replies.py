"""How a call's choices reach the client, for completions and chat alike: one JSON body once
all have finished, or server-sent events as they are generated. The endpoints pass in only
their choice shapes."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from brook_engine.core.output_stream import OutputStream
from brook_engine.outputs import CompletionOutput, RequestOutput
from brook_engine.server.engine_calls import collect, engine_failure
from brook_engine.server.errors import APIError


@dataclass(frozen=True)
class NewTokens:
    """What one output of a choice adds to what was streamed of that choice before."""

    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, float]]] | None  # None: not asked for
    text_offset: int  # characters of the choice sent before this output's delta_text


#: A finished choice in the whole body: (index, its completion) -> the choice object.
WholeChoice = Callable[[int, CompletionOutput], dict[str, Any]]
#: One streamed output: (index, output, what it adds) -> the choice objects to send, each in
#: a chunk of its own (none, to send nothing).
ChunkChoices = Callable[[int, RequestOutput, NewTokens], list[dict[str, Any]]]


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


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def usage(prompt_lengths: list[int], outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(prompt_lengths)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = prompt + completion
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


async def whole_reply(
    stream: OutputStream,
    request: Request,
    *,
    call_id: str,
    object_name: str,
    model: str,
    num_choices: int,
    prompt_lengths: list[int],
    choice: WholeChoice,
) -> JSONResponse:
    """Wait for every choice (``ClientGone`` if the client leaves first), then one body."""
    try:
        final = await collect(stream, request)
    finally:
        stream.close()
    outputs = [final[index] for index in range(num_choices)]
    choices = [choice(index, output.outputs[0]) for index, output in enumerate(outputs)]
    return JSONResponse(
        {
            "id": call_id,
            "object": object_name,
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage(prompt_lengths, outputs),
        }
    )


async def stream_events(
    stream: AsyncIterable[tuple[int, RequestOutput]],
    *,
    call_id: str,
    object_name: str,
    model: str,
    chunk_choices: ChunkChoices,
    opening: Iterable[dict[str, Any]] = (),
    usage_prompt_lengths: list[int] | None = None,
) -> AsyncIterator[str]:
    """The events of a streamed call: a chunk per ``opening`` choice, then the chunks
    ``chunk_choices`` makes of each output, then (with ``usage_prompt_lengths``) a usage
    chunk, then ``[DONE]``. An engine failure mid-stream is sent as an error event."""
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse(
            {
                "id": call_id,
                "object": object_name,
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
        )

    for choice in opening:
        yield chunk([choice])
    sent_chars: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in stream:
            offset = sent_chars.get(index, 0)
            sent_chars[index] = offset + len(output.delta_text)
            if output.finished:
                finals[index] = output
            new = NewTokens(output.delta_token_ids, output.delta_logprobs, offset)
            for choice in chunk_choices(index, output, new):
                yield chunk([choice])
        if usage_prompt_lengths is not None:
            outputs = [finals[i] for i in sorted(finals)]
            yield chunk([], usage=usage(usage_prompt_lengths, outputs))
    except Exception as exc:
        try:
            engine_failure(exc)
        except APIError as api_error:
            yield sse(api_error.body())
    yield sse("[DONE]")
