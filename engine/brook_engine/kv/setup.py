"""Setting a rank's KV cache up: calibrate the layers' storage dtypes where the policy asks
for it, size the cache from the device's budget (the same block count on every rank of a
replica), and allocate it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from brook_engine.config import EngineConfig, KVDType
from brook_engine.kv.cache import LayerKVCache
from brook_engine.kv.calibration import (
    MAX_CALIBRATION_TOKENS,
    Calibration,
    calibrate_layers,
    check_int8_calibration,
    summarize,
)
from brook_engine.kv.calibration_store import CalibrationStore
from brook_engine.kv.sizing import KVLayout, num_blocks

log = logging.getLogger(__name__)


class RankGroup(Protocol):
    """What setting up needs of a replica's ranks (``parallel.comm.Communicator``)."""

    def broadcast_object(self, obj: Any, kind: Any) -> Any: ...

    def min_int(self, value: int) -> int: ...


@dataclass(frozen=True)
class KVCacheSetup:
    layout: KVLayout  # as calibrated
    calibration: Calibration | None
    num_blocks: int
    caches: list[LayerKVCache]


@dataclass(frozen=True)
class CalibrationPass:
    """How this rank runs the calibration prefill: ``prefill(caches, ids)`` runs ``ids`` from
    position 0 through the rank's stage over ``caches`` (blocks 0, 1, …) while the
    ``attention`` modules' inputs are captured; ``rotary_at(positions)`` is the rotary
    table the layers project with."""

    prefill: Callable[[list[LayerKVCache], list[int]], None]
    attention: list[Any]
    rotary_at: Callable[[torch.Tensor], Any]
    #: ``hold(i)``: a context in which layer ``i``'s weights are in place (weight offload
    #: streams them in for the layer's turn only); None: always in place.
    hold: Callable[[int], AbstractContextManager[None]] | None = None


def set_up_kv_cache(
    config: EngineConfig,
    policy: list[KVDType],
    layout: KVLayout,
    max_model_len: int,
    budget: Callable[[], int],
    device: torch.device,
    calibration_ids: list[int] | None,
    calibration_pass: CalibrationPass,
    group: RankGroup | None,
    store: Callable[[list[int]], CalibrationStore] | None = None,
) -> KVCacheSetup:
    """``policy``: every layer's dtype in the whole model; ``layout``: this rank's.
    ``store(ids)``: where this rank's calibration on ``ids`` is kept (``shapes.cacheDir``):
    reused when it is there, kept when measured."""
    calibrating = config.kv_cache.needs_calibration
    if group is not None and calibrating:
        calibration_ids = group.broadcast_object(calibration_ids, list[int] | None)
    if "int8" in policy:  # every rank checks the whole policy: all of them stop alike
        check_int8_calibration(calibration_ids, max_model_len)
    calibration = None
    if calibrating and calibration_ids:
        kept = store(calibration_ids) if store is not None else None
        calibration = kept.load(device) if kept is not None else None
        if calibration is not None:
            log.info("KV calibration reused from %s", kept.path if kept else "")
        else:
            calibration = _calibrate(
                config, layout, max_model_len, device, calibration_ids, calibration_pass
            )
            if kept is not None:
                kept.save(calibration)
        layout = dataclasses.replace(layout, layer_kinds=calibration.chosen)
        if group is None:
            log.info("%s", summarize(calibration))
    blocks = num_blocks(config, max_model_len, layout.bytes_per_token, budget)
    if group is not None:  # every rank must hold the same blocks
        blocks = group.min_int(blocks)
    return KVCacheSetup(layout, calibration, blocks, layout.allocate(blocks, device, calibration))


@torch.inference_mode()
def _calibrate(
    config: EngineConfig,
    layout: KVLayout,
    max_model_len: int,
    device: torch.device,
    token_ids: list[int],
    calibration_pass: CalibrationPass,
) -> Calibration:
    """Measure each low-precision layer's attention error on ``token_ids`` (one prefill
    with exact KV) and choose its storage dtype; see ``kv.calibration``. Under
    parallelism every rank measures its own layers and heads in the same pass."""
    ids = token_ids[: min(len(token_ids), max_model_len, MAX_CALIBRATION_TOKENS)]
    exact = dataclasses.replace(layout, layer_kinds=["auto"] * len(layout.layer_kinds))
    caches = exact.allocate(-(-len(ids) // layout.block_size), device)
    return calibrate_layers(
        calibration_pass.attention,
        lambda: calibration_pass.prefill(caches, list(ids)),
        calibration_pass.rotary_at,
        layout.layer_kinds,
        layout.dtype,
        config.kv_cache.dynamic_precision,
        len(ids),
        max_model_len,
        hold=calibration_pass.hold,
    )
