"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget (``max_num_batched_tokens``). Running sequences go first,
decodes before prefills, so streams keep flowing; prompts are cut into chunks that fit the
budget (chunked prefill); waiting sequences join while budget and sequence slots remain.
When KV blocks run out, the most recently arrived running sequence is preempted: its blocks
are freed and it is recomputed later from its tokens (prompt and output so far).

A pipeline keeps several steps in flight: sequences in a step not yet collected are neither
scheduled again nor preempted, and each step takes about its share (``1 / steps in flight``)
of the sequences and tokens, so the steps stay balanced and no stage starves. Torch-free.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from brook_engine.config import SchedulerConfig
from brook_engine.core.sequence import FinishReason, Sequence, SequenceStatus
from brook_engine.kv.blocks import BlockManager


class QueueFullError(RuntimeError):
    """The waiting queue is at ``scheduler.maxWaitingRequests``; retry later:
    ``retry_after_seconds`` is the engine's estimate of when the queue has moved on."""

    def __init__(self, message: str, retry_after_seconds: int = 1) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


@dataclass
class ScheduledBatch:
    """The sequences of one step and the number of new tokens each computes."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    kv_blocked: bool = False  # a waiting sequence stayed out for want of KV blocks

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"{len(self.waiting)} requests are waiting (scheduler.maxWaitingRequests); "
                "retry later"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self, share: int = 1) -> ScheduledBatch:
        """The next step: sequences not in flight, at most ``1 / share`` of the live
        sequences and of the tokens they wait for (``share`` = steps in flight)."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        max_seqs = len(self.running) + len(self.waiting)
        if share > 1:
            max_seqs = -(-max_seqs // share)
            if self.config.chunked_prefill:  # (unchunked, a prompt must fit whole)
                demand = sum(s.num_uncomputed_tokens for s in self.running)
                demand += sum(s.num_uncomputed_tokens for s in self.waiting)
                budget = min(budget, max(1, -(-demand // share)))
        scheduled: set[int] = set()
        # Decodes first, then unfinished prefills; oldest first within each.
        for seq in sorted(
            self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival_time)
        ):
            if seq.in_flight or seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            if len(batch.seqs) >= max_seqs:
                break
            num_new = self._fit(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue
            if not self._make_room(seq, num_new, scheduled, batch):
                continue  # seq itself was preempted
            self.block_manager.grow(seq.block_table, seq.num_computed_tokens + num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            scheduled.add(id(seq))
            budget -= num_new
        if batch.num_preempted:
            return batch  # memory is short: admit nobody new this step
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(batch.seqs) < max_seqs
        ):
            seq = self.waiting[0]
            shared = self.block_manager.share_prefix(seq)
            num_new = self._fit(seq.num_uncomputed_tokens - shared, budget)
            total = seq.num_computed_tokens + shared + num_new
            if num_new == 0 or not self.block_manager.can_grow(seq.block_table, total):
                batch.kv_blocked = num_new > 0
                if shared:  # give the shared blocks back; they are looked up again later
                    self.block_manager.release(seq.block_table, seq)
                break
            seq.num_computed_tokens += shared
            self.block_manager.record_lookup(seq.num_tokens, shared)
            self.waiting.popleft()
            self.block_manager.grow(seq.block_table, total)
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _fit(self, wanted: int, budget: int) -> int:
        if wanted <= budget:
            return wanted
        return budget if self.config.chunked_prefill else 0

    def _make_room(
        self, seq: Sequence, num_new: int, scheduled: set[int], batch: ScheduledBatch
    ) -> bool:
        """Preempt the newest unscheduled running sequences until ``seq`` fits; False if
        ``seq`` had to go itself."""
        total = seq.num_computed_tokens + num_new
        while not self.block_manager.can_grow(seq.block_table, total):
            candidates = [s for s in self.running if id(s) not in scheduled and not s.in_flight]
            victim = max(candidates, key=lambda s: s.arrival_time)
            self._preempt(victim)
            batch.num_preempted += 1
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.release(seq.block_table, seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` and free every block it holds."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.release(seq.block_table, seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
