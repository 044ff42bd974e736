"""Setting a rank's offload up at load time: its plan from this process's device, the
pieces streamed into their tiers one at a time (at most one is ever held unpacked, so
loading never needs the whole model in memory), then the rings."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from brook_engine.config import EngineConfig
from brook_engine.offload.ledger import WeightLedger
from brook_engine.offload.plan import GIB, ModelShape, RankPlan, Target, plan_rank
from brook_engine.offload.state import OffloadState


def set_up_offload(
    holder: Any,
    layers: nn.ModuleList,
    plan: RankPlan,
    config: EngineConfig,
    device: torch.device,
    ledger: WeightLedger,
    load_piece: Callable[[nn.Module, str], None],
    progress: bool,
) -> OffloadState:
    """Store ``plan``'s streamed pieces (``load_piece(module, name)`` fills one in host
    memory) and start the streamer; ``holder.streamer`` is set."""
    pool = config.offload.cpu_memory_pool_gb
    if pool is None and device.type == "cpu":
        pool_limit: int | None = 0  # on CPU the host is the device's own memory
    else:
        pool_limit = None if pool is None else int(pool * GIB)
    state = OffloadState(
        plan, layers, device, ledger, holder, pool_limit, config.offload.prefetch_layers
    )
    state.load_streamed(load_piece, progress)
    return_freed_memory()
    state.build_streamer()
    return state


def return_freed_memory() -> None:
    """Hand the pieces' freed load buffers back to the system. glibc keeps freed blocks of
    up to 32 MiB in the heap once it has seen one freed, so reading a model piece by piece
    would otherwise leave the process holding several times its budget."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def runtime_target(device: torch.device, dtype: torch.dtype) -> Target:
    """The plan's view of this process's device: what packs and tiles weights here."""
    from brook_engine.layers import cpu_kernels
    from brook_engine.layers.linear import cpu_packing_supported

    on_cpu = device.type == "cpu"
    return Target(
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        cpu_packs_float=on_cpu and cpu_packing_supported(dtype),
        cpu_tiles_int8=on_cpu and cpu_kernels.library() is not None,
    )


def rank_plan(
    config: EngineConfig,
    shape: ModelShape,
    device: torch.device,
    dtype: torch.dtype,
    rank: int,
    stage: int,
    tp_rank: int,
    layers: tuple[int, int],
    first: bool,
    last: bool,
) -> RankPlan | None:
    """This rank's memory plan, or None without offload."""
    if config.offload.policy == "none":
        return None
    target = runtime_target(device, dtype)
    return plan_rank(config, shape, target, rank, stage, tp_rank, layers, first, last)
