"""What a request returns: text, token ids, finish reason, optional logprobs and timings.

Each step returns an output for every request that gained tokens or ended. What that step
added is in the ``delta_*`` fields; the whole text, token ids and logprobs (and the prompt's
ids) are in the final output only (``finished``), so a long request costs no copy of
everything it generated at every step."""

from __future__ import annotations

from dataclasses import dataclass, field

Logprob = tuple[float, dict[int, float]]  # (sampled token's logprob, {token: logprob} top-n)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[Logprob] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # the final output's; empty before
    outputs: list[CompletionOutput]  # whole text, ids and logprobs in the final output
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    delta_text: str = ""  # text added since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)  # tokens added since then
    delta_logprobs: list[Logprob] | None = None  # their logprobs, when asked for
    error: str | None = None  # why the request failed (finish reason "error")
