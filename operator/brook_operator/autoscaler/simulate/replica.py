"""One replica of the engine as a fluid model: a waiting queue, requests in (chunked, FIFO)
prefill and decoding requests, advanced over a span of time event by event.

An engine step with ``B`` decoding sequences and ``P`` prefill tokens (``P`` = what is left of
the prefill queue, at most ``max_batched_tokens - B``) takes ``s = step_time(B, P)``: decode
advances ``1/s`` iterations per second and prefill ``P/s`` tokens per second, all of them to
the oldest prompt first. Between two events (a prompt finishes prefill, a request finishes
decoding, the KV cache fills) the rates are constant, so the time of each event is exact in
the model and a span costs O(events), not O(batch).

Decoding requests share one counter ``d`` of decode iterations: a request remembers ``d``
when it starts and has generated ``d - d_start`` tokens; the one to finish next is on top of a
heap keyed by ``d_start + output``. KV held = prompt tokens of admitted requests + tokens
generated so far. When decode growth fills the cache, the newest request is preempted
(recompute: back to the head of the waiting queue, its prompt now including what it
generated), and nothing new is admitted until a request finishes.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from brook_operator.autoscaler.simulate.profile import Profile

WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3
_END, _PREFILLED, _FINISHED, _KV_FULL = 0, 1, 2, 3


class Job:
    """One request's state as it moves through a replica."""

    __slots__ = (
        "arrival",
        "d_start",
        "epoch",
        "index",
        "output",
        "prefill_left",
        "prompt",
        "state",
    )

    def __init__(self, index: int, arrival: float, prompt: int, output: int) -> None:
        self.index = index
        self.arrival = arrival
        self.prompt = float(prompt)
        """Tokens to prefill and hold: the input, plus what was generated before a
        preemption."""
        self.output = float(output)
        """Tokens still to generate."""
        self.prefill_left = 0.0
        self.d_start = 0.0
        self.epoch = 0
        """Which admission this is (entries of earlier ones in heaps are stale)."""
        self.state = WAITING


class Outcome:
    """Per-request results the replicas of one run write into (index = request)."""

    def __init__(self, num_requests: int, slo_seconds: float) -> None:
        self.ttft = [math.nan] * num_requests
        self.finished = [math.nan] * num_requests
        self.slo_seconds = slo_seconds
        self.misses = 0
        """Requests whose first token came later than the SLO so far."""

        self.completed = 0
        self.preemptions = 0


class Replica:
    def __init__(
        self, name: str, profile: Profile, created: float, ready_at: float, outcome: Outcome
    ) -> None:
        self.name = name
        self.profile = profile
        self.created = created
        self.ready_at = ready_at
        self.removed: float | None = None
        self.draining = False
        self.outcome = outcome
        self.waiting: deque[Job] = deque()
        self.prefilling: deque[Job] = deque()
        self.prefill_pending = 0.0
        """Prompt tokens still to prefill, over ``prefilling``."""

        self.decoding: list[tuple[float, int, Job]] = []
        """Heap of (d at which it finishes, epoch, job); entries of preempted jobs are stale."""

        self.num_decoding = 0
        self.sum_d_start = 0.0
        self.prompt_held = 0.0
        self.d = 0.0
        self.epoch = 0
        self.admitted: list[tuple[int, Job]] = []
        """(epoch, job) in admission order: the newest is preempted first."""

        self.blocked = False
        """A preemption happened: admit nothing until a request finishes."""

        self.prompt_tokens_received = 0.0
        self.tokens_generated = 0.0
        """The engine's demand counters: prompt tokens received, tokens generated."""

    def is_ready(self, now: float) -> bool:
        return self.ready_at <= now

    @property
    def kv_held(self) -> float:
        return self.prompt_held + self.num_decoding * self.d - self.sum_d_start

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + self.num_decoding

    def is_empty(self) -> bool:
        return not self.waiting and not self.prefilling and not self.num_decoding

    def add(self, job: Job) -> None:
        self.waiting.append(job)
        self.prompt_tokens_received += job.prompt

    def advance(self, now: float, span: float) -> None:
        """Run the engine from ``now`` for ``span`` seconds."""
        profile = self.profile
        budget = profile.max_batched_tokens
        capacity = profile.kv_cache_tokens
        t, end = now, now + span
        while True:
            if self.waiting and not self.blocked:
                self._admit()
            num_decoding = self.num_decoding
            prefill = 0.0
            if self.prefilling:
                head = self.prefilling[0]
                if head.prefill_left <= 1e-6:  # done up to rounding
                    self._prefilled(t)
                    continue
                # The sum can drift below the head's share by rounding; the head is exact.
                pending = max(self.prefill_pending, head.prefill_left)
                prefill = min(budget - num_decoding, pending)
            remaining = end - t
            if (not num_decoding and prefill <= 0) or remaining <= 0:
                return
            step = profile.step_time(num_decoding, prefill)
            seg, event = remaining, _END
            if prefill > 0:
                until = head.prefill_left * step / prefill
                if until < seg:
                    seg, event = until, _PREFILLED
            if num_decoding:
                heap = self.decoding
                while heap[0][2].state != DECODE or heap[0][2].epoch != heap[0][1]:
                    heapq.heappop(heap)
                until = max(0.0, (heap[0][0] - self.d) * step)
                if until < seg:
                    seg, event = until, _FINISHED
                until = max(0.0, (capacity - self.kv_held) * step / num_decoding)
                if until < seg:
                    seg, event = until, _KV_FULL
            if prefill > 0:
                done = seg * prefill / step
                head.prefill_left -= done
                self.prefill_pending -= done
            self.d += seg / step
            self.tokens_generated += num_decoding * seg / step
            t += seg
            if event == _PREFILLED:
                self._prefilled(t)
            elif event == _FINISHED:
                self._finish(t)
            elif event == _KV_FULL:
                self._preempt()
            else:
                return

    def _admit(self) -> None:
        max_seqs = self.profile.max_num_seqs
        capacity = self.profile.kv_cache_tokens
        waiting = self.waiting
        while waiting:
            job = waiting[0]
            if self.num_running >= max_seqs or capacity - self.kv_held < job.prompt:
                return
            waiting.popleft()
            self.epoch += 1
            job.epoch = self.epoch
            job.state = PREFILL
            job.prefill_left = job.prompt
            self.prefilling.append(job)
            self.prefill_pending += job.prompt
            self.prompt_held += job.prompt
            self.admitted.append((self.epoch, job))

    def _prefilled(self, now: float) -> None:
        """The oldest prompt is prefilled: its first token is out."""
        job = self.prefilling.popleft()
        self.prefill_pending = self.prefill_pending - job.prefill_left if self.prefilling else 0.0
        self.tokens_generated += 1  # the prefill step's token
        outcome = self.outcome
        if math.isnan(outcome.ttft[job.index]):
            ttft = now - job.arrival
            outcome.ttft[job.index] = ttft
            if ttft > outcome.slo_seconds:
                outcome.misses += 1
        if job.output <= 1:
            self.prompt_held -= job.prompt
            self._done(job, now)
            return
        job.state = DECODE
        job.d_start = self.d - 1  # the prefill step produced the first token
        self.num_decoding += 1
        self.sum_d_start += job.d_start
        heapq.heappush(self.decoding, (job.d_start + job.output, job.epoch, job))

    def _finish(self, now: float) -> None:
        heap = self.decoding
        while heap and heap[0][0] <= self.d + 1e-9:
            _, epoch, job = heapq.heappop(heap)
            if job.state != DECODE or job.epoch != epoch:
                continue
            self.num_decoding -= 1
            self.sum_d_start -= job.d_start
            self.prompt_held -= job.prompt
            self._done(job, now)
        if not self.num_decoding:
            self.sum_d_start = 0.0
            heap.clear()

    def _done(self, job: Job, now: float) -> None:
        job.state = DONE
        self.outcome.finished[job.index] = now
        self.outcome.completed += 1
        self.blocked = False
        if not self.num_running:
            self.admitted.clear()

    def _preempt(self) -> None:
        """KV is full: the newest request goes back to the head of the queue (recompute)."""
        if self.prefilling:
            job = self.prefilling.pop()
            self.prefill_pending = (
                self.prefill_pending - job.prefill_left if self.prefilling else 0.0
            )
            self.prompt_held -= job.prompt
        else:
            while True:
                epoch, job = self.admitted.pop()
                if job.state == DECODE and job.epoch == epoch:
                    break
            generated = self.d - job.d_start
            self.num_decoding -= 1
            self.sum_d_start -= job.d_start
            self.prompt_held -= job.prompt
            job.prompt += generated
            job.output -= generated
        job.state = WAITING
        self.waiting.appendleft(job)
        self.outcome.preemptions += 1
        self.blocked = bool(self.num_running)
