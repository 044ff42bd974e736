"""Where each rank sits in a replica and which layers each pipeline stage holds (torch-free).

Ranks are laid out tensor-innermost: rank = stage × tensor + tensor_rank, so a stage's
tensor-parallel group is a run of consecutive ranks and lands in one pod whenever a pod has
at least ``tensor`` devices (its all-reduces then stay on the fast in-node links).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    tensor: int
    pipeline: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of {self.world_size}")

    @classmethod
    def single(cls) -> Topology:
        return cls(1, 1, 0)

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor

    @property
    def stage(self) -> int:
        return self.rank // self.tensor

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline - 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler (and the HTTP server)."""
        return self.rank == 0

    @property
    def sampler_rank(self) -> int:
        """The rank that samples: the last stage's first tensor rank."""
        return (self.pipeline - 1) * self.tensor

    @property
    def is_sampler(self) -> bool:
        return self.rank == self.sampler_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [stage * self.tensor + t for t in range(self.tensor)]

    @property
    def next_rank(self) -> int | None:
        """This rank's peer in the next stage (same tensor rank), if any."""
        return None if self.is_last_stage else self.rank + self.tensor

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first_stage else self.rank - self.tensor


def split_layers(
    num_layers: int,
    stages: int,
    layer_cost: float = 1.0,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> list[int]:
    """Layers per stage, contiguous, minimising the costliest stage. ``first_extra`` and
    ``last_extra`` are the costs, in layer units, of what only the first stage (embedding)
    and the last stage (final norm, LM head, sampling) run."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")

    def fits(limit: float) -> list[int] | None:
        # Greedy from the front: each stage takes as many layers as fit under ``limit``,
        # leaving at least one layer for every later stage.
        counts: list[int] = []
        left = num_layers
        for stage in range(stages):
            remaining_stages = stages - stage - 1
            extra = (first_extra if stage == 0 else 0.0) + (
                last_extra if stage == stages - 1 else 0.0
            )
            if stage == stages - 1:
                take = left
                if take * layer_cost + extra > limit + 1e-9:
                    return None
            else:
                take = max(1, math.floor((limit - extra) / layer_cost + 1e-9))
                take = min(take, left - remaining_stages)
                if take < 1:
                    return None
            counts.append(take)
            left -= take
        return counts

    low, high = 0.0, num_layers * layer_cost + first_extra + last_extra
    best = fits(high)
    assert best is not None
    for _ in range(60):  # bisection on the largest stage cost
        mid = (low + high) / 2
        found = fits(mid)
        if found is None:
            low = mid
        else:
            high, best = mid, found
    return best


def stage_bounds(counts: list[int], stage: int) -> tuple[int, int]:
    """[first, end) layer indexes of ``stage``."""
    start = sum(counts[:stage])
    return start, start + counts[stage]
