"""Request bodies of the OpenAI API as this server accepts them.

Strict: unknown fields and wrong types are refused with the field named, rather than
ignored. Fields the engine cannot honour are accepted only at their neutral value
(``presence_penalty: 0``, ``logit_bias: {}``...), so clients that send the defaults work and
clients that rely on them learn at once. vLLM's extensions (``top_k``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``cache_salt``) are accepted
too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

#: Most choices (``n``) one request may ask for.
MAX_N = 16
#: Most tokens one request may ask for (the model length bounds it further).
MAX_TOKENS_LIMIT = 1_048_576
MAX_STOP = 16
MAX_PROMPTS = 256
#: Penalties the engine does not apply, accepted only at the value that means "no penalty".
_NEUTRAL_PENALTIES = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    """Send a last chunk with the token usage of the whole request."""


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=512)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(default=None, max_length=512)
    # vLLM extensions
    top_k: int = Field(default=0, ge=-1, le=1_000_000)
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    skip_special_tokens: bool = True
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    """Mixed into the prefix-cache keys: only requests with the same salt share cached KV."""

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else value or []
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in items):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator(*_NEUTRAL_PENALTIES)
    @classmethod
    def _no_penalty(cls, value: float, info: ValidationInfo) -> float:
        neutral = _NEUTRAL_PENALTIES[info.field_name or ""]
        if value != neutral:
            raise ValueError(f"not supported by this server; leave it at {neutral}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("not supported by this server; leave it out")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream: true")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: Any
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> list[str] | list[list[int]]:
        def ids(items: list[Any]) -> bool:
            return all(type(t) is int for t in items)

        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value:
            if ids(value):
                return [value]
            if all(isinstance(p, str) for p in value) or all(
                isinstance(p, list) and ids(p) for p in value
            ):
                if len(value) > MAX_PROMPTS:
                    raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
                return value
        raise ValueError(
            "expected a non-empty string, list of strings, list of token ids, or list of "
            "token-id lists"
        )

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported by this server; leave it false")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("not supported by this server; leave it out")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("only best_of equal to n is supported; leave it out")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    # Fields a response message carries, so that clients may append it to the history as is.
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"part {i} has type {kind!r}; this model reads text parts only"
                    )
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value not in (None, {"type": "text"}):
            raise ValueError("only {'type': 'text'} is supported by this server")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise ValueError("tool calling is not supported by this server")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
