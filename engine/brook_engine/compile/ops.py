"""The parts of a decoder layer a compiled graph calls but does not compile, as registered
PyTorch custom ops with shape functions, so the compiler traces through them instead of
breaking the graph.

- ``brook::linear``: a projection of the layer being run — whatever its module does
  (Brook's float32, one-row and W8A16 kernels, oneDNN's, an accelerator's GEMM). The
  weights stay the modules' own: a graph holds none, so one graph serves every layer, and
  weight offload swaps a slot's contents under it.
- ``brook::attention``: attention over the paged KV cache (Brook's decode kernel, prefill
  spans), on the step's real tokens only: padding rows write no KV and read zeros.
- ``brook::all_reduce``: the tensor-parallel sum of a row-parallel projection.

What they run on comes from the step being run (``StepContext``): the stage's layers, the
KV caches, the attention metadata and the step's real token count, set by the code that
calls the graph around each layer. Their shape functions need none of it, so a graph can be
traced and compiled on another thread while steps run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from brook_engine.kv.cache import LayerKVCache
from brook_engine.layers.attention import AttentionMetadata, paged_attention

#: The projections of a decoder layer, by the index ``brook::linear`` takes.
PARTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class StepContext:
    """The step a graph is running: what its custom ops act on."""

    layers: Sequence[Any]  # the stage's decoder layers
    caches: Sequence[LayerKVCache]
    meta: AttentionMetadata
    tokens: int  # real tokens; rows beyond are padding
    layer: int = 0  # the layer being run


_current: StepContext | None = None


@contextmanager
def running(context: StepContext) -> Iterator[StepContext]:
    global _current
    _current = context
    try:
        yield context
    finally:
        _current = None


def _context() -> StepContext:
    if _current is None:
        raise RuntimeError("a Brook custom op ran outside a compiled step")
    return _current


def _module(part: int) -> Any:
    context = _context()
    layer = context.layers[context.layer]
    owner = layer.self_attn if part < 2 else layer.mlp
    return getattr(owner, PARTS[part])


@torch.library.custom_op("brook::linear", mutates_args=())
def linear(x: torch.Tensor, part: int, out_features: int) -> torch.Tensor:
    """Projection ``PARTS[part]`` of the layer being run, [tokens, out_features]: of the
    step's real rows only (padding rows get zeros), so padding costs no weight reading."""
    module = _module(part)
    n = _context().tokens
    if n == x.shape[0]:
        out: torch.Tensor = module(x)
        return out
    out = x.new_empty((x.shape[0], out_features))
    out[:n] = module(x[:n])
    out[n:] = 0
    return out


@linear.register_fake
def _linear_shape(x: torch.Tensor, part: int, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


@torch.library.custom_op("brook::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Paged attention of the layer being run for the step's real tokens (writing their
    keys and values to the cache); zeros for padding rows."""
    context = _context()
    n = context.tokens
    cache = context.caches[context.layer]
    out = paged_attention(q[:n], k[:n], v[:n], cache, context.meta, scale)
    if n == q.shape[0]:
        return out
    full = q.new_empty(q.shape)
    full[:n] = out
    full[n:] = 0
    return full


@attention.register_fake
def _attention_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op("brook::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the tensor-parallel group of the layer being run."""
    context = _context()
    comm = context.layers[context.layer].self_attn.comm
    out: torch.Tensor = comm.all_reduce(x.clone())  # reduced in place: not the graph's buffer
    return out


@all_reduce.register_fake
def _all_reduce_shape(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)
