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
counted."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

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


class AdaptivePolicy:
    """Moves pieces between resident and streamed from the engine's KV pressure."""

    def __init__(
        self,
        state: OffloadState,
        block_bytes: int,
        grow_kv: Callable[[int], None],
        shrink_kv: Callable[[int], bool],
        priority: list[PieceKind],
    ) -> None:
        self.state = state
        self.block_bytes = max(1, block_bytes)  # KV bytes of one block on this rank
        self.grow_kv = grow_kv
        self.shrink_kv = shrink_kv  # False when the cache's last blocks are busy
        order = [k for k in PIECE_KINDS if k not in priority] + list(priority)
        self.kind_order: list[PieceKind] = order
        self.evicted: list[tuple[list[Key], int]] = []  # (pieces, blocks added), newest last
        self.pressure = 0
        self.calm = 0
        # hysteresis, in steps (instance attributes so a test can shorten them)
        self.pressure_steps, self.calm_steps = PRESSURE_STEPS, CALM_STEPS
        self.cooldown_steps = COOLDOWN_STEPS
        self.since_change = self.cooldown_steps
        self.counters = AdaptiveCounters()

    def after_step(self, kv_blocked: bool, waiting: int) -> None:
        self.since_change += 1
        if kv_blocked:
            self.pressure += 1
            self.calm = 0
        else:
            self.pressure = 0
            self.calm = self.calm + 1 if waiting == 0 else 0
        if self.since_change < self.cooldown_steps:
            return
        if self.pressure >= self.pressure_steps:
            self._offload_more()
        elif self.calm >= self.calm_steps and self.evicted:
            self._bring_back()

    # -- out -------------------------------------------------------------------------------

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

    def _offload_more(self) -> None:
        chosen = self._choose()
        if not chosen:
            return
        state = self.state
        before = state.ledger.held
        state.evict_many(chosen)
        freed = before - state.ledger.held
        blocks = freed // self.block_bytes
        if blocks > 0:
            self.grow_kv(blocks)
        self.evicted.append((chosen, blocks))
        self.counters.offloaded += 1
        self.counters.blocks_added += blocks
        self._changed()
        log.info(
            "weight offload (adaptive): KV pressure for %d steps: %s now stream, the KV cache "
            "grew by %d blocks; %s",
            self.pressure_steps,
            ", ".join(f"layer {i} {k}" for i, k in chosen),
            blocks,
            state.describe(),
        )

    # -- back ------------------------------------------------------------------------------

    def _bring_back(self) -> None:
        chosen, blocks = self.evicted[-1]
        if blocks > 0 and not self.shrink_kv(blocks):
            return  # the cache's last blocks are still in use: try again next step
        self.state.restore_many(chosen)
        self.evicted.pop()
        self.counters.restored += 1
        self.counters.blocks_removed += blocks
        self._changed()
        log.info(
            "weight offload (adaptive): no KV pressure for %d steps: %s resident again, the "
            "KV cache gave back %d blocks; %s",
            self.calm_steps,
            ", ".join(f"layer {i} {k}" for i, k in chosen),
            blocks,
            self.state.describe(),
        )

    def _changed(self) -> None:
        self.since_change = 0
        self.pressure = 0
        self.calm = 0
