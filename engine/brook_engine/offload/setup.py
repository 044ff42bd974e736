"""Setting a rank's streamed pieces up at load time: allocate the ring's slots (charged to
the ledger), read each streamed piece on its own into host memory, put its bytes in the host
pool or the spill file, and bind its tensors to its slot. At most one streamed piece is
ever held in float or unpacked form, so loading never needs the whole model in memory."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from brook_engine.config import EngineConfig
from brook_engine.offload.ledger import WeightLedger
from brook_engine.offload.payload import bind, layout, pack
from brook_engine.offload.plan import PIECE_KINDS, ModelShape, RankPlan, Target, plan_rank
from brook_engine.offload.streamer import Ring, WeightStreamer
from brook_engine.offload.tiers import HostPool, SpillFile

_PART = {"attention": "self_attn", "ffn": "mlp"}


def stream_pieces(
    layers: nn.ModuleList,
    plan: RankPlan,
    device: torch.device,
    ledger: WeightLedger,
    load_piece: Callable[[nn.Module, str], None],
    progress: bool,
) -> WeightStreamer | None:
    """The streamer of ``plan``'s streamed pieces (None when everything is resident).
    ``load_piece(module, name)`` fills one piece's module in host memory."""
    if not plan.streamed:
        return None
    start = plan.layers[0]
    kinds = [k for k in PIECE_KINDS if k in plan.slots]
    slots: dict[str, list[torch.Tensor]] = {}
    for kind in kinds:
        size = plan.piece_bytes[kind]
        slots[kind] = []
        for s in range(plan.slots[kind]):
            ledger.charge(size, "slots", f"{kind} slot {s}")
            slots[kind].append(torch.empty(size, dtype=torch.uint8, device=device))
    keys: dict[str, list[int]] = {k: [] for k in kinds}
    layer_pieces: dict[int, list[tuple[int, int]]] = {}
    host = HostPool(pinned=device.type != "cpu")
    spill = SpillFile() if plan.host_pieces < len(plan.streamed) else None
    accelerator = device.type != "cpu"
    bar = tqdm(plan.streamed, desc="Offloading weights", unit="piece", disable=not progress)
    for key, (layer, kind) in enumerate(bar):
        name = f"model.layers.{layer - start}.{_PART[kind]}"
        module = layers[layer - start].get_submodule(_PART[kind])
        load_piece(module, name)
        handles, size = layout(module)
        if size != plan.piece_bytes[kind]:
            raise RuntimeError(
                f"{name} holds {size} bytes where the memory plan counted "
                f"{plan.piece_bytes[kind]}; the plan and the loader disagree (a bug)"
            )
        in_pool = key < plan.host_pieces
        buffer = host.new_buffer(size) if in_pool else torch.empty(size, dtype=torch.uint8)
        pack(module, handles, buffer)
        if in_pool:
            host.put(key, buffer)
        else:
            assert spill is not None
            spill.put(key, buffer)
        position = len(keys[kind])
        keys[kind].append(key)
        ring = kinds.index(kind)
        bind(handles, slots[kind][position % len(slots[kind])])
        for sub in module.modules():
            sub.__dict__["streamed"] = True  # packing and one-row copies leave it alone
        layer_pieces.setdefault(layer - start, []).append((ring, position))
    staging = None
    if accelerator and spill is not None:
        staging = [
            [torch.empty(t.numel(), dtype=torch.uint8, pin_memory=True) for t in slots[k]]
            for k in kinds
        ]
    rings = [Ring(slots[k], keys[k]) for k in kinds]
    return_freed_memory()
    return WeightStreamer(device, rings, layer_pieces, host, spill, ledger, staging)


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
