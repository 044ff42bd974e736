"""How one request samples its tokens, validated with messages that name the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from brook_engine.config.errors import describe_errors

#: Temperatures below this sample greedily, as vLLM does.
GREEDY_BELOW = 1e-5


class SamplingError(ValueError):
    """Sampling parameters that cannot be honoured; the message names the field."""


class SamplingParams(BaseModel):
    """Sampling parameters, named as in vLLM and the OpenAI API."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(default=16, ge=1, le=1_048_576)
    """Most tokens to generate."""

    min_tokens: int = Field(default=0, ge=0, le=1_048_576)
    """Tokens generated before EOS or stop token ids may end the request."""

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    """0 is greedy, and so is any temperature below ``GREEDY_BELOW`` (dividing logits by
    a near-zero temperature would overflow them)."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p."""

    top_k: int = Field(default=0, ge=0, le=1_000_000)
    """Sample among the k likeliest tokens; 0 disables."""

    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    """Seed of this request's random generator: the same seed gives the same tokens,
    whatever else is in the batch."""

    stop: tuple[str, ...] = Field(default=(), max_length=16)
    """Strings that end the request; they are not part of the returned text."""

    stop_token_ids: tuple[int, ...] = Field(default=(), max_length=64)
    """Token ids that end the request (besides EOS)."""

    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""

    logprobs: int | None = Field(default=None, ge=0, le=20)
    """Return the log-probability of each sampled token and of this many top alternatives."""

    skip_special_tokens: bool = True
    """Leave special tokens out of the returned text."""

    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    """Mixed into the prefix-cache keys: only requests with the same salt share KV blocks
    (one salt per tenant keeps tenants from probing each other's prompts by timing)."""

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop holds an empty string; remove it")
        return self

    @property
    def cache_extra(self) -> tuple[str, ...]:
        """Extra keys of this request's prefix-cache blocks."""
        return () if self.cache_salt is None else (self.cache_salt,)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> SamplingParams:
        """Build from user input; ``SamplingError`` names every bad or unknown field."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SamplingError("; ".join(describe_errors(cls, exc))) from None
