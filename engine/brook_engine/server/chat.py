"""POST /v1/chat/completions: a conversation rendered with the model's chat template, n
choices, whole or streamed."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from brook_engine.core.async_engine import SubRequest
from brook_engine.outputs import CompletionOutput, RequestOutput
from brook_engine.server.engine_calls import check_context, new_id, sampling_params, submit
from brook_engine.server.errors import APIError, invalid
from brook_engine.server.logprobs import chat_logprobs
from brook_engine.server.protocol import ChatCompletionRequest
from brook_engine.server.replies import EventStream, NewTokens, stream_events, whole_reply
from brook_engine.server.state import ServerState
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
    except RecursionError:
        raise invalid("nested too deeply to render; flatten it", "messages") from None
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
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = stream_events(
            stream,
            call_id=call_id,
            object_name="chat.completion.chunk",
            model=state.served_name,
            chunk_choices=partial(_chunk_choices, state),
            # Every choice opens with the role, as OpenAI's stream does.
            opening=[_delta(index, {"role": "assistant", "content": ""}) for index in range(req.n)],
            usage_prompt_lengths=[len(ids)] if include_usage else None,
        )
        return EventStream(events, stream.close)
    return await whole_reply(
        stream,
        request,
        call_id=call_id,
        object_name="chat.completion",
        model=state.served_name,
        num_choices=req.n,
        prompt_lengths=[len(ids)],
        choice=partial(_whole_choice, state),
    )


def _whole_choice(state: ServerState, index: int, completion: CompletionOutput) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": _logprobs(state, completion.token_ids, completion.logprobs),
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


def _delta(index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    choice.update(extra)
    return choice


def _chunk_choices(
    state: ServerState, index: int, output: RequestOutput, new: NewTokens
) -> list[dict[str, Any]]:
    """The new text (with the logprobs of its tokens), then a last delta with the reason the
    choice ended."""
    completion = output.outputs[0]
    logprobs = None
    if new.logprobs is not None and new.token_ids:
        logprobs = _logprobs(state, new.token_ids, new.logprobs)
    choices = []
    if output.delta_text or logprobs is not None:
        choices.append(_delta(index, {"content": output.delta_text}, logprobs=logprobs))
    if output.finished:
        choices.append(
            _delta(
                index,
                {},
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
        )
    return choices


def _logprobs(
    state: ServerState, token_ids: list[int], logprobs: list[tuple[float, dict[int, float]]] | None
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    assert state.tokenizer is not None
    return chat_logprobs(state.tokenizer, token_ids, logprobs)
