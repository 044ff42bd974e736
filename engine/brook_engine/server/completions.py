"""POST /v1/completions: prompts (text or token ids) × n choices, whole or streamed."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from brook_engine.core.async_engine import SubRequest
from brook_engine.outputs import CompletionOutput, RequestOutput
from brook_engine.server.engine_calls import check_context, new_id, sampling_params, submit
from brook_engine.server.errors import APIError
from brook_engine.server.logprobs import completion_logprobs
from brook_engine.server.protocol import CompletionRequest
from brook_engine.server.replies import EventStream, NewTokens, stream_events, whole_reply
from brook_engine.server.state import ServerState

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
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = stream_events(
            stream,
            call_id=call_id,
            object_name="text_completion",
            model=state.served_name,
            chunk_choices=partial(_chunk_choices, state),
            usage_prompt_lengths=lengths if include_usage else None,
        )
        return EventStream(events, stream.close)
    return await whole_reply(
        stream,
        request,
        call_id=call_id,
        object_name="text_completion",
        model=state.served_name,
        num_choices=len(calls),
        prompt_lengths=lengths,
        choice=partial(_whole_choice, state),
    )


def _whole_choice(state: ServerState, index: int, completion: CompletionOutput) -> dict[str, Any]:
    return {
        "index": index,
        "text": completion.text,
        "logprobs": _logprobs(state, completion.token_ids, completion.logprobs, 0),
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


def _chunk_choices(
    state: ServerState, index: int, output: RequestOutput, new: NewTokens
) -> list[dict[str, Any]]:
    """The new text with the logprobs of its tokens; the last one carries the reason the
    choice ended. An output that adds nothing is not sent."""
    completion = output.outputs[0]
    logprobs = _logprobs(state, new.token_ids, new.logprobs, new.text_offset)
    if not output.delta_text and not output.finished and logprobs is None:
        return []
    return [
        {
            "index": index,
            "text": output.delta_text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
    ]


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
