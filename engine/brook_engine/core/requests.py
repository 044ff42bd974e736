"""A request as the engine tracks it: its sequence and text so far, the checks a prompt must
pass, what ends it (EOS, a stop token or string, the length) and the output it returns."""

from __future__ import annotations

from dataclasses import dataclass

from brook_engine.core.sequence import FinishReason, Sequence
from brook_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from brook_engine.tokenizer import IncrementalDetokenizer


class RequestError(ValueError):
    """A request the engine cannot take; the message says which field and why."""


def check_prompt(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Raise ``RequestError`` for a prompt the model cannot take."""
    if not ids:
        raise RequestError("prompt is empty; send at least one token")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise RequestError(
            f"prompt has {len(ids)} tokens but the model length is {max_model_len}, "
            "leaving no room to generate; shorten the prompt"
        )


@dataclass
class Request:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    emitted: int = 0  # characters of text already returned as deltas
    emitted_tokens: int = 0  # output tokens already returned as deltas

    def finish_reason(
        self, token: int, eos_token_ids: frozenset[int], max_model_len: int
    ) -> FinishReason | None:
        """Why ``token`` (just appended) ends the request, or None; a stop string is cut
        from the text, and the stop string or token kept as the sequence's stop reason."""
        seq, params = self.seq, self.seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if token in eos_token_ids and not params.ignore_eos:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return FinishReason.STOP
        if params.stop:
            text = self.detokenizer.text
            window = text[-(max(map(len, params.stop)) + 64) :]
            for stop in params.stop:
                at = window.find(stop)
                if at >= 0:
                    self.detokenizer.text = text[: len(text) - len(window) + at]
                    seq.stop_reason = stop
                    return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def output(self, now: float, error: str | None = None) -> RequestOutput:
        """The request as of now: what it added since its last output as deltas; the whole
        text, ids and logprobs once it has finished."""
        seq = self.seq
        finished = seq.is_finished
        text = self.detokenizer.text
        # Hold back what could be the start of a stop string until it is settled.
        hold = 0 if finished or not seq.params.stop else max(map(len, seq.params.stop)) - 1
        upto = max(self.emitted, len(text) - hold)
        delta, self.emitted = text[self.emitted : upto], upto
        first_new = seq.num_prompt_tokens + self.emitted_tokens
        self.emitted_tokens = seq.num_output_tokens
        wants_logprobs = seq.params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=text if finished else "",
            token_ids=seq.output_token_ids if finished else [],
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if wants_logprobs and finished else None,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=self.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens] if finished else [],
            outputs=[completion],
            finished=finished,
            metrics=RequestMetrics(
                arrival_time=seq.arrival_time,
                first_token_time=seq.first_token_time,
                finished_time=now if finished else None,
                num_preemptions=seq.num_preemptions,
            ),
            delta_text=delta,
            delta_token_ids=seq.token_ids[first_new:],
            delta_logprobs=seq.logprobs[first_new - seq.num_prompt_tokens :]
            if wants_logprobs
            else None,
            error=error,
        )

    def failed_output(self, error: str, now: float) -> RequestOutput:
        """The last output of a request that failed (built from nothing that could fail)."""
        seq = self.seq
        return RequestOutput(
            request_id=seq.request_id,
            prompt=self.prompt,
            prompt_token_ids=[],
            outputs=[CompletionOutput(0, "", [], FinishReason.ERROR.value)],
            finished=True,
            metrics=RequestMetrics(seq.arrival_time, seq.first_token_time, now),
            error=error,
        )
