"""Token logprobs in the two OpenAI shapes: the legacy completions one and the chat one."""

from __future__ import annotations

import itertools
from typing import Any

from brook_engine.tokenizer import Tokenizer


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
