"""The overlap monitor: how much of the replica's communication its computation hides.

Every rank records, per step, the intervals it spent computing and the lifetime of every
communication it started (issue → completion). A blocking operation (the tensor-parallel
all-reduce the next matmul needs) is exposed for all of its time. An asynchronous one (a
pipeline stage's ``isend`` of activations) is exposed for the part of its lifetime that no
computation of that rank overlapped:

    exposed(op) = |lifetime(op) \\ compute intervals|        (blocking: |lifetime(op)|)
    overlap     = 1 - Σ exposed / Σ total                     (1 when nothing was sent)

Receives are not counted as communication: a stage waiting for its input is waiting for the
stage before it to compute, which is the pipeline bubble, reported on its own as
``bubble = 1 - Σ compute / (ranks × Σ step time)``. Control messages (rank 0's step plans,
sampled tokens coming back) are timed by kind but left out of the ratio: they are the
engine's own traffic, not the model's.

Host clocks time the intervals; on accelerators, where kernels run asynchronously, the
runner synchronizes the stream at the boundaries it times.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

#: Communication kinds; "control" stays out of the overlap ratio.
KINDS = ("all_reduce", "all_gather", "p2p", "control")

Interval = tuple[float, float]

#: Steps of compute an asynchronous operation's lifetime is matched against.
RECENT_STEPS = 4


@dataclass
class Counters:
    """Running totals of one rank (or of the whole replica after a reduce), in seconds."""

    comm_total: float = 0.0  # model communication, issue → completion
    comm_exposed: float = 0.0
    compute: float = 0.0
    step_wall: float = 0.0  # rank 0 only: plan sent → tokens back
    steps: float = 0.0
    by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    stage_compute: list[float] = field(default_factory=lambda: [0.0])  # per pipeline stage
    tokens: float = 0.0  # rank 0: tokens the steps computed
    prefill_tokens: float = 0.0  # rank 0: of them, in prompt chunks (not decodes)

    def vector(self) -> list[float]:
        return [
            self.comm_total,
            self.comm_exposed,
            self.compute,
            self.step_wall,
            self.steps,
            *(self.by_kind[k] for k in KINDS),
            self.tokens,
            self.prefill_tokens,
            *self.stage_compute,
        ]

    @classmethod
    def from_vector(cls, values: list[float]) -> Counters:
        total, exposed, compute, wall, steps = values[:5]
        kinds = values[5 : 5 + len(KINDS)]
        tokens, prefill = values[5 + len(KINDS) : 7 + len(KINDS)]
        stages = list(values[7 + len(KINDS) :])
        by_kind = dict(zip(KINDS, kinds, strict=True))
        return cls(total, exposed, compute, wall, steps, by_kind, stages, tokens, prefill)

    def minus(self, other: Counters) -> Counters:
        return Counters.from_vector(
            [a - b for a, b in zip(self.vector(), other.vector(), strict=True)]
        )

    @property
    def overlap(self) -> float:
        if self.comm_total <= 0:
            return 1.0
        return max(0.0, min(1.0, 1.0 - self.comm_exposed / self.comm_total))

    @property
    def prefill_share(self) -> float:
        """Share of the tokens computed in prompt chunks: a window's load mix."""
        return self.prefill_tokens / self.tokens if self.tokens > 0 else 0.0

    @property
    def tokens_per_second(self) -> float | None:
        return self.tokens / self.step_wall if self.step_wall > 0 else None

    def bubble(self, ranks: int) -> float:
        """Share of the ranks' step time spent not computing."""
        if self.step_wall <= 0:
            return 0.0
        return max(0.0, min(1.0, 1.0 - self.compute / (ranks * self.step_wall)))


class OverlapMonitor:
    """Collects one rank's intervals step by step; thread-safe for the completion watcher."""

    def __init__(self, stage: int = 0, stages: int = 1) -> None:
        self.totals = Counters(stage_compute=[0.0] * stages)
        self.stage = stage
        self._lock = threading.Lock()
        self._compute: list[Interval] = []
        self._blocking: list[tuple[str, Interval]] = []
        self._waits: list[Interval] = []
        self._async: list[tuple[str, Interval]] = []
        self._control: list[float] = []
        # Compute of the last few steps: with steps in flight, an activation sent in one
        # step may complete while the next one computes.
        self._recent: deque[list[Interval]] = deque(maxlen=RECENT_STEPS)

    def compute(self, start: float, end: float) -> None:
        self._compute.append((start, end))

    def waited(self, start: float, end: float) -> None:
        """The compute thread waited this long for an asynchronous operation: not compute,
        and not communication time of its own (the operation's lifetime already counts)."""
        self._waits.append((start, end))

    def blocking(self, kind: str, start: float, end: float) -> None:
        self._blocking.append((kind, (start, end)))

    def finished_async(self, kind: str, start: float, end: float) -> None:
        with self._lock:
            self._async.append((kind, (start, end)))

    def control(self, seconds: float) -> None:
        self._control.append(seconds)

    def end_step(self, wall: float = 0.0, tokens: int = 0, prefill_tokens: int = 0) -> None:
        """Fold the step's intervals into the totals. Call once every asynchronous operation
        of the step has completed."""
        with self._lock:
            asyncs, self._async = self._async, []
        blocking = [span for _, span in self._blocking]
        compute = _subtract(_union(self._compute), _union(blocking + self._waits))
        self._recent.append(compute)
        recent = _union([span for spans in self._recent for span in spans])
        t = self.totals
        t.compute += _length(compute)
        t.stage_compute[self.stage] += _length(compute)
        for kind, (start, end) in self._blocking:
            t.comm_total += end - start
            t.comm_exposed += end - start
            t.by_kind[kind] += end - start
        for kind, (start, end) in asyncs:
            hidden = _length(_intersect([(start, end)], recent))
            t.comm_total += end - start
            t.comm_exposed += (end - start) - hidden
            t.by_kind[kind] += end - start
        t.by_kind["control"] += sum(self._control)
        t.step_wall += wall
        t.tokens += tokens
        t.prefill_tokens += prefill_tokens
        t.steps += 1
        self._compute, self._blocking, self._control, self._waits = [], [], [], []


class Adaptation:
    """Raise the micro-batches in flight while the overlap stays below the floor — when that
    measurably raises throughput.

    More micro-batches put more of a stage's sends behind its next micro-batch's compute
    (with m micro-batches, only the last one's transfer has nothing to hide behind) and
    shrink the bubble ((p - 1) / m); under tensor parallelism alone, two interleaved
    micro-batches hide each other's all-reduces. The price is smaller matrix
    multiplications, and where decoding streams the weights from memory (small batches,
    CPUs) every micro-batch streams them again. So after ``patience`` consecutive windows
    below the floor, a raise to ``2m`` (at most ``ceiling``) is tried against ``m`` over four
    windows (2m, m, m, 2m — this order cancels a load that drifts steadily between windows),
    and kept only if its throughput (tokens per second of busy time) beats ``m``'s by at
    least ``margin`` (5 %: windows on a shared host vary by that much, and a raise has a
    known cost); otherwise the count stays at ``m`` for good. Prompt tokens are much cheaper
    per token than decodes, so a window whose share of prompt tokens differs from the
    trial's first window by more than ``mix_tolerance`` (a burst of new requests, or the end
    of one) makes the rates incomparable: the trial is dropped, the count goes back to
    ``m``, and a new trial may start later. It never comes
    down otherwise (a load that dips would make it oscillate).
    """

    # Raised arm or not, window by window: A B B A cancels a load that drifts steadily
    # (a draining batch) between windows, which A B A B would credit to the first arm.
    TRIAL = (True, False, False, True)

    def __init__(
        self,
        start: int,
        ceiling: int,
        floor: float = 0.7,
        patience: int = 2,
        margin: float = 0.05,
        mix_tolerance: float = 0.1,
    ) -> None:
        self.micro_batches = start
        self.ceiling = max(start, ceiling)
        self.floor = floor
        self.patience = patience
        self.margin = margin
        self.mix_tolerance = mix_tolerance
        self.dropped_trials = 0  # abandoned because the load's mix changed
        self._trial_mix: float | None = None
        self.history: deque[float] = deque(maxlen=patience)
        self.changes: list[tuple[int, float]] = []  # (count kept, overlap that started it)
        self.settled = False  # a raise cost throughput: no more raises
        self._trial: list[tuple[bool, float]] | None = None  # (raised arm?, its rate)
        self._base = start
        self._overlap_at_trial = 0.0

    @property
    def trying(self) -> bool:
        return self._trial is not None

    def observe(
        self,
        overlap: float,
        had_comm: bool,
        rate: float | None = None,
        mix: float | None = None,
    ) -> int:
        """One window's overlap (and throughput and share of prompt tokens, when known);
        returns the count for the next window."""
        if self._trial is not None:
            if self._trial_mix is None:
                self._trial_mix = mix
            elif mix is not None and abs(mix - self._trial_mix) > self.mix_tolerance:
                self._trial, self._trial_mix = None, None
                self.dropped_trials += 1
                self.micro_batches = self._base
                return self.micro_batches
            return self._continue_trial(rate)
        if not had_comm:
            return self.micro_batches
        self.history.append(overlap)
        if (
            not self.settled
            and len(self.history) == self.patience
            and max(self.history) < self.floor
            and self.micro_batches < self.ceiling
        ):
            self.history.clear()
            self._base = self.micro_batches
            self._overlap_at_trial = overlap
            if rate is None:  # nothing to compare with: raise outright
                self.micro_batches = min(self.ceiling, 2 * self._base)
                self.changes.append((self.micro_batches, overlap))
                return self.micro_batches
            self._trial = []
            self.micro_batches = self._arm(0)
        return self.micro_batches

    def observe_window(self, window: Counters) -> int:
        """``observe`` a window of the replica's summed counters; logs what changes."""
        kept, settled = len(self.changes), self.settled
        count = self.observe(
            window.overlap,
            window.comm_total > 0,
            window.tokens_per_second,
            window.prefill_share if window.tokens > 0 else None,
        )
        if len(self.changes) > kept:
            log.info(
                "overlap %.2f below %.2f: %d micro-batches from now on",
                self.changes[-1][1],
                self.floor,
                count,
            )
        elif self.settled and not settled:
            log.info("more micro-batches cost throughput: staying at %d", count)
        return count

    def _arm(self, index: int) -> int:
        return min(self.ceiling, 2 * self._base) if self.TRIAL[index] else self._base

    def _continue_trial(self, rate: float | None) -> int:
        assert self._trial is not None
        index = len(self._trial)
        self._trial.append((self.TRIAL[index], rate if rate is not None else 0.0))
        if len(self._trial) < len(self.TRIAL):
            self.micro_batches = self._arm(len(self._trial))
            return self.micro_batches
        raised = [r for arm, r in self._trial if arm]
        base = [r for arm, r in self._trial if not arm]
        self._trial, self._trial_mix = None, None
        if sum(raised) / len(raised) >= (sum(base) / len(base)) * (1 + self.margin):
            self.micro_batches = min(self.ceiling, 2 * self._base)
            self.changes.append((self.micro_batches, self._overlap_at_trial))
        else:
            self.micro_batches = self._base
            self.settled = True
        return self.micro_batches


def _union(spans: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for s1, e1 in a:
        for s2, e2 in b:
            start, end = max(s1, s2), min(e1, e2)
            if start < end:
                out.append((start, end))
    return out


def _subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in a:
        pieces = [(start, end)]
        for s2, e2 in b:
            next_pieces = []
            for s1, e1 in pieces:
                if e2 <= s1 or s2 >= e1:
                    next_pieces.append((s1, e1))
                    continue
                if s1 < s2:
                    next_pieces.append((s1, s2))
                if e2 < e1:
                    next_pieces.append((e2, e1))
            pieces = next_pieces
        out.extend(pieces)
    return out


def _length(spans: list[Interval]) -> float:
    return sum(end - start for start, end in spans)


def micro_batch_adaptation(
    tensor: int, pipeline: int, steps_in_flight: int, pinned: int | None
) -> Adaptation:
    """The micro-batches a replica starts from and may rise to (``pinned`` fixes both).

    Pipeline: with a step per stage in flight the stages are busy already and one
    micro-batch per step is the start; with fewer steps in flight, micro-batches keep them
    busy. Either way more micro-batches hide more of each step's sends. Tensor parallel
    alone: two micro-batches, interleaved, hide the all-reduces; more only shrink the matrix
    multiplications. One device: nothing to hide."""
    if pipeline > 1:
        start = 1 if steps_in_flight >= pipeline else pipeline
        ceiling = 8 * pipeline
    else:
        start, ceiling = 1, 2 if tensor > 1 else 1
    return Adaptation(pinned or start, pinned or ceiling)
