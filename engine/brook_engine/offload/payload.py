"""A streamed piece's tensors as one flat byte range: which tensors a module's forward reads
(parameters, one-row copies, W8A16's tiled weight), where each sits in a slot (aligned as
the plan counts it), their bytes packed for a tier, and the module re-pointed at a slot.

Every streamed piece of one kind has the same layout, so a piece's tensors are bound once to
views of its slot and stay bound: filling the slot is all a step does (the one-row kernel's
per-layer plans see the same pointers every step)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from brook_engine.offload.plan import aligned

_ATTRS = ("one_row", "packed")
_TILED_FIELDS = ("packed", "scales", "bias")


@dataclass(frozen=True)
class Handle:
    """One tensor of a piece: its holder, how it is held, and its place in the slot."""

    owner: object
    name: str
    how: Literal["param", "attr", "field"]
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def _tensors(module: nn.Module) -> list[tuple[object, str, str, torch.Tensor]]:
    found: list[tuple[object, str, str, torch.Tensor]] = []
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and param.numel():
                found.append((sub, name, "param", param))
        for name in _ATTRS:
            value = sub.__dict__.get(name)
            if isinstance(value, torch.Tensor) and value.numel():
                if value.is_mkldnn or value.dim() != 2:
                    raise ValueError("a streamed piece cannot hold packed weights")
                found.append((sub, name, "attr", value))
        tiled = sub.__dict__.get("tiled")
        if tiled is not None and dataclasses.is_dataclass(tiled):
            for name in _TILED_FIELDS:
                value = getattr(tiled, name)
                if isinstance(value, torch.Tensor) and value.numel():
                    found.append((tiled, name, "field", value))
    return found


def layout(module: nn.Module) -> tuple[list[Handle], int]:
    """The handles of ``module``'s tensors and the bytes of the range they take."""
    handles, offset = [], 0
    for owner, name, how, tensor in _tensors(module):
        nbytes = tensor.numel() * tensor.element_size()
        handles.append(
            Handle(owner, name, how, tuple(tensor.shape), tensor.dtype, offset, nbytes)  # type: ignore[arg-type]
        )
        offset += aligned(nbytes)
    return handles, offset


def pack(module: nn.Module, handles: list[Handle], out: torch.Tensor) -> None:
    """Copy ``module``'s tensors into ``out`` (uint8, the layout's size) at their offsets."""
    current = {(id(o), n): t for o, n, _, t in _tensors(module)}
    for h in handles:
        tensor = current[(id(h.owner), h.name)].detach().contiguous()
        out[h.offset : h.offset + h.nbytes].copy_(tensor.reshape(-1).view(torch.uint8))


def bind(handles: list[Handle], slot: torch.Tensor) -> None:
    """Point every handle's holder at its view of ``slot``."""
    for h in handles:
        point(h, slot[h.offset : h.offset + h.nbytes].view(h.dtype).view(h.shape))


def point(h: Handle, tensor: torch.Tensor) -> None:
    """Make ``h``'s holder hold ``tensor``."""
    if h.how == "param":
        param = h.owner._parameters[h.name]  # type: ignore[attr-defined]
        param.data = tensor
    elif h.how == "attr":
        setattr(h.owner, h.name, tensor)
    else:
        object.__setattr__(h.owner, h.name, tensor)  # a frozen dataclass (TiledWeight)
