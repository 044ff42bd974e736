"""POST /v1/completions: prompts (text or token ids) × n choices, whole or streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from brook_engine.async_engine import SubRequest
from brook_engine.outputs import RequestOutput
from brook_engine.server.errors import APIError
from brook_engine.server.generation import (
    EventStream,
    ServerState,
    check_context,
    collect,
    completion_logprobs,
    engine_failure,
    new_id,
    sampling_params,
    sse,
    submit,
    usage,
)
from brook_engine.server.protocol import CompletionRequest

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for completions


async def create_completion(
    state: ServerState, req: CompletionRequest, request: Request, arrival: float
) -> Response:
    tokenizer = state.tokenizer
    assert tokenizer is not None
    prompts: list[Any] = req.prompt
    prompt_ids: list[list[int]] = await asyncio.to_thread(
        lambda: [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    )
    calls: list[SubRequest] = []
    call_id = new_id("cmpl")
    for i, ids in enumerate(prompt_ids):
        param = "prompt" if len(prompt_ids) == 1 else f"prompt[{i}]"
        if not ids:
            raise APIError(400, f"{param}: empty; send at least one token", param=param)
        bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"{param}: token id {bad} is outside the vocabulary [0, {state.vocab_size})",
                param=param,
            )
        max_tokens = check_context(
            len(ids), req.max_tokens or DEFAULT_MAX_TOKENS, state.max_model_len, param
        )
        params = sampling_params(req, max_tokens, req.logprobs)
        for j in range(req.n):
            calls.append(SubRequest(f"{call_id}-{i}-{j}", ids, params))
    stream = await submit(state, calls, arrival)
    lengths = [len(ids) for ids in prompt_ids]
    if req.stream:
        return EventStream(_stream(state, req, call_id, stream, lengths), stream.close)
    try:
        final = await collect(stream, request)
    finally:
        stream.close()
    outputs = [final[i] for i in range(len(calls))]
    choices = []
    for index, output in enumerate(outputs):
        completion = output.outputs[0]
        choices.append(
            {
                "index": index,
                "text": completion.text,
                "logprobs": _logprobs(state, completion.token_ids, completion.logprobs, 0),
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
        )
    body = {
        "id": call_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.served_name,
        "choices": choices,
        "usage": usage(lengths, outputs),
    }
    return JSONResponse(body)


def _logprobs(
    state: ServerState,
    token_ids: list[int],
    logprobs: list[tuple[float, dict[int, float]]] | None,
    offset: int,
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    assert state.tokenizer is not None
    return completion_logprobs(state.tokenizer, token_ids, logprobs, offset)


async def _stream(
    state: ServerState,
    req: CompletionRequest,
    call_id: str,
    stream: Any,
    lengths: list[int],
) -> AsyncIterator[str]:
    created = int(time.time())
    sent_tokens: dict[int, int] = {}
    sent_chars: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in stream:
            completion = output.outputs[0]
            start = sent_tokens.get(index, 0)
            sent_tokens[index] = len(completion.token_ids)
            logprobs = None
            if completion.logprobs is not None:
                logprobs = _logprobs(
                    state,
                    completion.token_ids[start:],
                    completion.logprobs[start:],
                    sent_chars.get(index, 0),
                )
            sent_chars[index] = sent_chars.get(index, 0) + len(output.delta_text)
            if not output.delta_text and not output.finished and logprobs is None:
                continue
            if output.finished:
                finals[index] = output
            yield sse(
                {
                    "id": call_id,
                    "object": "text_completion",
                    "created": created,
                    "model": state.served_name,
                    "choices": [
                        {
                            "index": index,
                            "text": output.delta_text,
                            "logprobs": logprobs,
                            "finish_reason": completion.finish_reason,
                            "stop_reason": completion.stop_reason,
                        }
                    ],
                }
            )
        if req.stream_options and req.stream_options.include_usage:
            yield sse(
                {
                    "id": call_id,
                    "object": "text_completion",
                    "created": created,
                    "model": state.served_name,
                    "choices": [],
                    "usage": usage(lengths, [finals[i] for i in sorted(finals)]),
                }
            )
    except Exception as exc:
        try:
            engine_failure(exc)
        except APIError as api_error:
            yield api_error.sse()
    yield sse("[DONE]")
