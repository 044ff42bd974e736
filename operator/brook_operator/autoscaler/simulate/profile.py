"""Replica profiles: how fast one replica of a deployment runs, how much KV cache it has and
how long it takes to start, as a JSON file (``profiles/<name>.json``).

An engine step with ``B`` decoding sequences and ``P`` prefill tokens takes
``base + per_sequence·B + per_prefill_token·P`` seconds; ``B + P`` is at most
``max_batched_tokens`` and ``B`` at most ``max_num_seqs``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from brook_operator.autoscaler.simulate.simulation_error import SimulationError

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
DEFAULT_PROFILE = "smollm2-135m-cpu"


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class StepSeconds(_Strict):
    base: float = Field(gt=0)
    """Seconds of an engine step whatever its size (weights read, launch, sampling)."""

    per_sequence: float = Field(ge=0)
    """Seconds each decoding sequence adds to a step."""

    per_prefill_token: float = Field(ge=0)
    """Seconds each prompt token prefilled in the step adds."""


class Profile(_Strict):
    name: str = Field(min_length=1)
    description: str
    source: list[str]
    """How the figures were obtained: the commands and their raw results, or 'assumed'."""

    step_seconds: StepSeconds
    max_num_seqs: int = Field(ge=1)
    max_batched_tokens: int = Field(ge=1)
    """Tokens per step: one per decoding sequence plus the prefill chunk."""

    kv_cache_tokens: int = Field(ge=1)
    cold_start_seconds: float = Field(ge=0)
    """From the decision to add a replica to its first request (pod start, weights load)."""

    cold_start_uncached_seconds: float | None = Field(default=None, ge=0)
    """The same start without a warm compile cache (``shapes.cacheDir``): the replica
    compiles its graphs before it serves. ``brook autoscale simulate --uncached-start``
    replays with it."""

    ttft_slo_seconds: float = Field(gt=0)
    max_replicas: int = Field(ge=1, le=1000)
    overlap: list[tuple[float, float]] | None = None
    """Communication/compute overlap ratio by decoding batch, ``[batch, ratio]`` points
    interpolated linearly and clamped at the ends; null: no communication (ratio 1)."""

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        if self.max_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_batched_tokens ({self.max_batched_tokens}) is below max_num_seqs "
                f"({self.max_num_seqs}): a step needs a token per decoding sequence"
            )
        if self.overlap is not None:
            if not self.overlap:
                raise ValueError("overlap: give at least one [batch, ratio] point, or null")
            batches = [b for b, _ in self.overlap]
            if batches != sorted(set(batches)):
                raise ValueError(f"overlap: batches {batches} must increase")
            if any(not 0 <= r <= 1 for _, r in self.overlap):
                raise ValueError("overlap: ratios must lie in [0, 1]")
        return self

    def step_time(self, num_decoding: int, num_prefill_tokens: float) -> float:
        s = self.step_seconds
        return s.base + s.per_sequence * num_decoding + s.per_prefill_token * num_prefill_tokens

    def overlap_ratio(self, batch: float) -> float:
        points = self.overlap
        if points is None:
            return 1.0
        if batch <= points[0][0]:
            return points[0][1]
        for (b0, r0), (b1, r1) in itertools.pairwise(points):
            if batch <= b1:
                return r0 + (r1 - r0) * (batch - b0) / (b1 - b0)
        return points[-1][1]


#: the engine's bench names for its starts (``brook-engine bench --workload cold-start``)
WARM_START, UNCACHED_START = "compile, warm cache", "compile, empty cache"


def with_measured_start(profile: Profile, bench: Path, pod_start_seconds: float) -> Profile:
    """``profile`` with its starts from a ``brook-engine bench --workload cold-start --json``
    report: each start's median seconds from process start to the first token, plus
    ``pod_start_seconds`` for scheduling the pod and starting its container."""
    if not pod_start_seconds >= 0:
        raise SimulationError(f"--pod-start-seconds {pod_start_seconds:g}: give 0 or more")
    try:
        starts = json.loads(bench.read_text(encoding="utf-8"))["starts"]
        warm = float(starts[WARM_START]["first_token"])
        uncached = float(starts[UNCACHED_START]["first_token"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SimulationError(
            f"{bench}: not a cold-start report ({type(exc).__name__}: {exc}); write one with "
            "`brook-engine bench --model MODEL --workload cold-start --json > FILE`"
        ) from None
    if not (warm >= 0 and uncached >= 0) or max(warm, uncached) == float("inf"):
        raise SimulationError(f"{bench}: the starts must be finite seconds, not {warm}, {uncached}")
    return profile.model_copy(
        update={
            "cold_start_seconds": warm + pod_start_seconds,
            "cold_start_uncached_seconds": uncached + pod_start_seconds,
        }
    )


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str = DEFAULT_PROFILE) -> Profile:
    """A profile file, or the shipped profile of that name."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILES_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise SimulationError(
                f"profile {name_or_path!r}: no such file and no shipped profile of that name "
                f"(shipped: {', '.join(shipped_profiles())})"
            )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SimulationError(f"{path}: unreadable profile: {exc}") from None
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise SimulationError(f"{path}: {_first_problem(exc)}") from None


def _first_problem(exc: ValidationError) -> str:
    errors = exc.errors()
    where = ".".join(str(p) for p in errors[0]["loc"]) or "profile"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {errors[0]['msg']}{more}"
