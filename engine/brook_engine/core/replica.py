"""The replica's layout and the facts of the whole replica that rank 0 reports.

Layout: the layers of each pipeline stage and the part of the model a rank holds. Facts:
per global layer its KV storage dtype and calibration error (the highest over the tensor
ranks, each of which calibrates its own heads), and the KV bytes per token and weight bytes
summed over every rank."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from brook_engine.config import EngineConfig, KVDType
from brook_engine.layers.tensor_parallel import Shard
from brook_engine.models.arch import ModelArch
from brook_engine.offload.plan import stage_layer_counts as plan_stage_layer_counts
from brook_engine.parallel.comm import Communicator
from brook_engine.parallel.topology import Topology, stage_bounds

log = logging.getLogger(__name__)


def stage_layer_counts(config: EngineConfig, arch: ModelArch) -> list[int]:
    """Layers per pipeline stage: as configured, else balanced by cost, the LM head (and
    sampling) counted against the last stage in units of one decoder layer (the memory
    plan's rule, ``offload.plan.stage_layer_counts``)."""
    return plan_stage_layer_counts(config, arch.shape)


def rank_shard(config: EngineConfig, arch: ModelArch, topology: Topology) -> Shard:
    """The part of the model ``topology``'s rank holds: its stage's layers, its tensor slice."""
    start, end = stage_bounds(stage_layer_counts(config, arch), topology.stage)
    return Shard(
        topology.tp_rank,
        topology.tensor,
        start,
        end,
        topology.is_first_stage,
        topology.is_last_stage,
    )


@dataclass(frozen=True)
class ReplicaFacts:
    layer_kinds: list[KVDType]
    calibration_errors: list[float | None] | None  # None: not calibrated
    kv_bytes_per_token: int
    weight_bytes: int


@dataclass(frozen=True)
class RankFacts:
    """One rank's facts, as it sends them to rank 0."""

    stage: int
    tp_rank: int
    facts: ReplicaFacts


def gather_replica_facts(local: ReplicaFacts, comm: Communicator | None) -> ReplicaFacts:
    """Every rank calls it with its own facts; rank 0 gets the replica's, the others their
    own back."""
    if comm is None:
        return local
    topology = comm.topology
    mine = RankFacts(topology.stage, topology.tp_rank, local)
    everyone: list[RankFacts] | None = comm.gather_object(mine, RankFacts)
    if everyone is None:
        return local
    kinds: list[KVDType] = []
    errors: list[float | None] | None = [] if local.calibration_errors is not None else None
    for stage in range(topology.pipeline):
        ranks = [r for r in everyone if r.stage == stage]
        kinds += next(r.facts.layer_kinds for r in ranks if r.tp_rank == 0)
        if errors is not None:
            per_rank = [r.facts.calibration_errors for r in ranks]
            per_rank = [e for e in per_rank if e is not None]
            for layer_errors in zip(*per_rank, strict=True):
                known = [e for e in layer_errors if e is not None]
                errors.append(max(known) if known else None)
    if errors is not None:
        log.info(
            "KV calibration over %d ranks: layer dtypes %s, errors %s",
            topology.world_size,
            kinds,
            ["-" if e is None else f"{e:.4f}" for e in errors],
        )
    return ReplicaFacts(
        kinds,
        errors,
        sum(r.facts.kv_bytes_per_token for r in everyone),
        sum(r.facts.weight_bytes for r in everyone),
    )
