"""The adaptive policy: weights give way to the KV cache under pressure and come back when
it is gone.

After every step the engine reports whether a waiting request stayed out for want of KV
blocks (or a running one was preempted). After ``PRESSURE_STEPS`` such steps in a row, and
no sooner than ``COOLDOWN_STEPS`` after the last change, resident pieces are made to stream
(FFN pieces first unless ``priorityLayers`` says otherwise, spread over the stage) and the
KV cache grows by the blocks the freed bytes hold. After ``CALM_STEPS`` steps with nothing
waiting, the pieces evicted last come back, once the cache's last blocks are idle and it
can shrink by their bytes. The weights' device bytes never pass the budget (they only fall
below it), and weights + KV together stay where they started. Each change is logged and
counted.

Two parts: the policy (``AdaptivePolicy``, rank 0: when) and each rank's mover
(``RankMover``: which of its own pieces). Under tensor and pipeline parallelism rank 0
decides and every rank moves its own share between the same two steps, with nothing in
flight; the cache grows by the fewest blocks any rank's freed bytes hold, since the block
table is shared (``ModelRunner.offload_out``/``offload_back``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from brook_engine.offload.plan import PIECE_KINDS, PieceKind
from brook_engine.offload.state import Key, OffloadState

log = logging.getLogger(__name__)

PRESSURE_STEPS = 4
CALM_STEPS = 64
COOLDOWN_STEPS = 16


@dataclass
class AdaptiveCounters:
    offloaded: int = 0  # changes that moved weights out
    restored: int = 0  # changes that brought them back
    blocks_added: int = 0
    blocks_removed: int = 0


class RankMover:
    """One rank's side: which of its resident pieces stream next, and which come back."""

    def __init__(self, state: OffloadState, priority: list[PieceKind]) -> None:
        self.state = state
        self.kind_order: list[PieceKind] = [k for k in PIECE_KINDS if k not in priority] + list(
            priority
        )
        self.moved: list[list[Key]] = []  # per change out, newest last (empty: nothing here)

    def _choose(self) -> list[Key]:
        """The next pieces to stream: of the first kind in order that has resident pieces,
        the one farthest from the streamed pieces of its kind; as many as it takes to
        free more than the slots a new ring would cost."""
        state = self.state
        streamed = set(state.streamed)
        for kind in self.kind_order:
            resident = [k for k in state.pieces if k[1] == kind and k not in streamed]
            if not resident:
                continue
            have = [k[0] for k in streamed if k[1] == kind]
            slots_now = min(state.prefetch + 1, len(have))
            chosen: list[Key] = []
            while resident:
                taken = have + [c[0] for c in chosen]
                pick = max(
                    resident,
                    key=lambda k: min((abs(k[0] - t) for t in taken), default=len(state.pieces)),
                )
                resident.remove(pick)
                chosen.append(pick)
                slots_after = min(state.prefetch + 1, len(have) + len(chosen))
                if len(chosen) > slots_after - slots_now:
                    return chosen  # frees at least one piece beyond the new slots
            return []  # this kind cannot pay for its ring: nothing to gain
        return []

    def move_out(self) -> int:
        """Stream the next pieces; the device bytes freed (0: nothing left to move)."""
        chosen = self._choose()
        self.moved.append(chosen)
        if not chosen:
            return 0
        before = self.state.ledger.held
        self.state.evict_many(chosen)
        log.info("weight offload (adaptive): %s now stream", _names(chosen))
        return before - self.state.ledger.held

    def move_back(self) -> None:
        """Make the pieces of the last change out resident again."""
        chosen = self.moved.pop()
        if chosen:
            self.state.restore_many(chosen)
            log.info("weight offload (adaptive): %s resident again", _names(chosen))


class AdaptivePolicy:
    """Rank 0: when to trade weights for KV blocks and back, from the engine's KV pressure.

    ``move_out()`` moves the next pieces on every rank and returns the blocks the cache grew
    by, or None when the move would not grow it (some rank had nothing left to move: the
    move is undone on every rank); ``move_back(blocks)`` undoes the last
    change, shrinking the cache by ``blocks``, and returns False (changing nothing) while
    the cache's last blocks are still in use. Both run with nothing in flight: the engine
    stops starting steps while ``wants_change`` and calls ``act`` once they are collected."""

    def __init__(
        self,
        move_out: Callable[[], int | None],
        move_back: Callable[[int], bool],
        describe: Callable[[], str],
        can_give_back: Callable[[int], bool],
    ) -> None:
        self.move_out = move_out
        self.move_back = move_back
        self.describe = describe
        self.can_give_back = can_give_back  # the cache's last ``blocks`` blocks are idle
        self.evicted: list[int] = []  # blocks added by each change out, newest last
        self.pressure = 0
        self.calm = 0
        self.exhausted = False  # nothing left to move out until something comes back
        # hysteresis, in steps (instance attributes so a test can shorten them)
        self.pressure_steps, self.calm_steps = PRESSURE_STEPS, CALM_STEPS
        self.cooldown_steps = COOLDOWN_STEPS
        self.since_change = self.cooldown_steps
        self.counters = AdaptiveCounters()
        self._wanted: Literal["out", "back"] | None = None

    @property
    def wants_change(self) -> bool:
        return self._wanted is not None

    def after_step(self, kv_blocked: bool, waiting: int) -> None:
        """Count one collected step; a change may then be wanted (``act`` makes it)."""
        self.since_change += 1
        if kv_blocked:
            self.pressure += 1
            self.calm = 0
        else:
            self.pressure = 0
            self.calm = self.calm + 1 if waiting == 0 else 0
        self._wanted = None
        if self.since_change < self.cooldown_steps:
            return
        if self.pressure >= self.pressure_steps and not self.exhausted:
            self._wanted = "out"
        elif self.calm >= self.calm_steps and self.evicted and self.can_give_back(self.evicted[-1]):
            self._wanted = "back"  # asked only when it can happen: a change drains the pipe

    def act(self) -> None:
        """Make the wanted change (nothing in flight)."""
        wanted, self._wanted = self._wanted, None
        if wanted == "out":
            self._offload_more()
        elif wanted == "back":
            self._bring_back()

    def _offload_more(self) -> None:
        blocks = self.move_out()
        if blocks is None:
            self.exhausted = True
            return
        self.evicted.append(blocks)
        self.counters.offloaded += 1
        self.counters.blocks_added += blocks
        self._changed()
        log.info(
            "weight offload (adaptive): KV pressure for %d steps: more weights stream, the KV "
            "cache grew by %d blocks; %s",
            self.pressure_steps,
            blocks,
            self.describe(),
        )

    def _bring_back(self) -> None:
        blocks = self.evicted[-1]
        if not self.move_back(blocks):
            return  # the cache's last blocks are still in use: try again next step
        self.evicted.pop()
        self.exhausted = False
        self.counters.restored += 1
        self.counters.blocks_removed += blocks
        self._changed()
        log.info(
            "weight offload (adaptive): no KV pressure for %d steps: weights resident again, "
            "the KV cache gave back %d blocks; %s",
            self.calm_steps,
            blocks,
            self.describe(),
        )

    def _changed(self) -> None:
        self.since_change = 0
        self.pressure = 0
        self.calm = 0


def _names(keys: list[Key]) -> str:
    return ", ".join(f"layer {i} {k}" for i, k in keys)
