"""One request's tokens and its place in the KV cache."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from brook_engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # cancelled
    ERROR = "error"  # this request failed (the others go on)


@dataclass(eq=False)
class Sequence:
    """Prompt plus generated tokens; ``num_computed_tokens`` of them have their KV cached."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    scheduled_time: float | None = None  # first admitted to the running batch
    first_token_time: float | None = None
    num_preemptions: int = 0
    in_flight: bool = False  # in a step the engine started and has not collected yet
    # Chained prefix keys of the leading full blocks of block_table (prefix sharing).
    prefix_keys: list[int] = field(default_factory=list)
    # Per generated token: (logprob of the sampled token, {token id: logprob} of the top ones)
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
