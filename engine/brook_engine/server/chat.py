"""POST /v1/chat/completions: a conversation rendered with the model's chat template, n
choices, whole or streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from brook_engine.async_engine import OutputStream, SubRequest
from brook_engine.outputs import RequestOutput
from brook_engine.server.errors import APIError, invalid
from brook_engine.server.generation import (
    EventStream,
    ServerState,
    chat_logprobs,
    check_context,
    collect,
    engine_failure,
    new_id,
    sampling_params,
    sse,
    submit,
    usage,
)
from brook_engine.server.protocol import ChatCompletionRequest
from brook_engine.tokenizer import ChatTemplateError, Tokenizer


def _render(tokenizer: Tokenizer, req: ChatCompletionRequest) -> list[int]:
    messages: list[dict[str, Any]] = []
    for message in req.messages:
        item: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": message.text(),
        }
        for name in ("name", "tool_call_id", "tool_calls"):
            value = getattr(message, name)
            if value is not None:
                item[name] = value
        messages.append(item)
    try:
        text = tokenizer.apply_chat_template(messages, req.add_generation_prompt)
    except ChatTemplateError as exc:
        raise invalid(str(exc), "messages") from None
    # The template writes any BOS itself.
    return tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, request: Request, arrival: float
) -> Response:
    tokenizer = state.tokenizer
    assert tokenizer is not None
    ids = await asyncio.to_thread(_render, tokenizer, req)
    if not ids:
        raise APIError(400, "the conversation renders to no tokens", param="messages")
    max_tokens = check_context(len(ids), req.token_limit, state.max_model_len, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, logprobs)
    call_id = new_id("chatcmpl")
    stream = await submit(
        state, [SubRequest(f"{call_id}-{j}", ids, params) for j in range(req.n)], arrival
    )
    if req.stream:
        return EventStream(_stream(state, req, call_id, stream, len(ids)), stream.close)
    try:
        final = await collect(stream, request)
    finally:
        stream.close()
    outputs = [final[j] for j in range(req.n)]
    choices = []
    for index, output in enumerate(outputs):
        completion = output.outputs[0]
        choices.append(
            {
                "index": index,
                "message": {"role": "assistant", "content": completion.text},
                "logprobs": _logprobs(state, completion.token_ids, completion.logprobs),
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
        )
    return JSONResponse(
        {
            "id": call_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.served_name,
            "choices": choices,
            "usage": usage([len(ids)], outputs),
        }
    )


def _logprobs(
    state: ServerState, token_ids: list[int], logprobs: list[tuple[float, dict[int, float]]] | None
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    assert state.tokenizer is not None
    return chat_logprobs(state.tokenizer, token_ids, logprobs)


async def _stream(
    state: ServerState,
    req: ChatCompletionRequest,
    call_id: str,
    stream: OutputStream,
    num_prompt_tokens: int,
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(index: int, delta: dict[str, Any], **extra: Any) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        choice.update(extra)
        return sse(
            {
                "id": call_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.served_name,
                "choices": [choice],
            }
        )

    # Every choice opens with the role, as OpenAI's stream does.
    for index in range(req.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    sent_tokens: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in stream:
            completion = output.outputs[0]
            start = sent_tokens.get(index, 0)
            sent_tokens[index] = len(completion.token_ids)
            logprobs = None
            if completion.logprobs is not None and len(completion.token_ids) > start:
                logprobs = _logprobs(
                    state, completion.token_ids[start:], completion.logprobs[start:]
                )
            if output.delta_text or logprobs is not None:
                yield chunk(index, {"content": output.delta_text}, logprobs=logprobs)
            if output.finished:
                finals[index] = output
                yield chunk(
                    index,
                    {},
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
        if req.stream_options and req.stream_options.include_usage:
            outputs = [finals[i] for i in sorted(finals)]
            yield sse(
                {
                    "id": call_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": state.served_name,
                    "choices": [],
                    "usage": usage([num_prompt_tokens], outputs),
                }
            )
    except Exception as exc:
        try:
            engine_failure(exc)
        except APIError as api_error:
            yield api_error.sse()
    yield sse("[DONE]")
