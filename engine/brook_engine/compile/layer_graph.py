"""One decoder layer as a graph of a fixed token count, traced and compiled.

The graph is the layer's code between its projections and attention: the residual adds and
RMSNorms, the rotary embedding, the SiLU gate, the reshapes — what the compiler fuses into
a few kernels — around the custom ops of ``compile.ops``. It holds no weights (the norms'
come in as inputs, the projections' stay in their modules), so one graph per token bucket
serves every layer of the stage, and compiling it takes seconds, not the whole model's
minutes. The sequence is the portable one eager runs (``layers.cpu_fused``), and the
compiler keeps eager's roundings (``emulate_precision_casts``), so the two agree.

Backends: Inductor on CPU (C++ with OpenMP) and CUDA (Triton); on Ascend NPUs the
graph-mode backend of ``torchair`` (imported only there).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from brook_engine.compile import ops
from brook_engine.device import DTYPES
from brook_engine.layers import cpu_fused
from brook_engine.layers.tensor_parallel import Shard
from brook_engine.models.arch import ModelArch

log = logging.getLogger(__name__)

#: What a compiled layer is called with: x, delta, cos, sin, the two norms' weights.
LayerGraph = Callable[..., Any]


@dataclass(frozen=True)
class LayerSpec:
    """What decides a decoder layer's graph: sizes of this rank's share, dtype, device."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # this rank's
    eps: float
    dtype: str  # float32, bfloat16, float16
    device: str  # cpu, cuda, npu
    reduce: bool  # tensor parallel: projections' outputs are summed over the group

    @classmethod
    def of_arch(
        cls, arch: ModelArch, tp_size: int, dtype: torch.dtype, device: torch.device
    ) -> LayerSpec:
        """The spec of a rank's layers (every rank's alike) of ``arch`` split ``tp_size``
        ways: what the engine and ``brook-engine compile`` both key the cache on."""
        kv_start, kv_end = Shard(tp_size=tp_size).kv_heads(arch.num_heads, arch.num_kv_heads)
        return cls(
            hidden=arch.hidden_size,
            heads=arch.num_heads // tp_size,
            kv_heads=kv_end - kv_start,
            head_dim=arch.head_dim,
            intermediate=arch.intermediate_size // tp_size,
            eps=float(arch.rms_norm_eps),
            dtype=str(dtype).removeprefix("torch."),
            device=device.type,
            reduce=tp_size > 1,
        )

    def facts(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def layer_function(spec: LayerSpec) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The layer as a function of (x, delta, cos, sin, norm1, norm2) → (residual, MLP
    output): ``DecoderLayer.forward`` with ``delta`` given (zeros on a stage's first layer)."""
    heads, kv_heads, dim = spec.heads, spec.kv_heads, spec.head_dim
    q_size, rotated = heads * dim, heads + kv_heads
    qkv_size = (heads + 2 * kv_heads) * dim
    scale = dim**-0.5
    eps, hidden, inter = spec.eps, spec.hidden, spec.intermediate

    def run(
        x: torch.Tensor,
        delta: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        norm1: torch.Tensor,
        norm2: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.shape[0]
        normed, x = cpu_fused.add_rms_norm(x, delta, norm1, eps)
        qkv = torch.ops.brook.linear(normed, 0, qkv_size).view(tokens, -1, dim)
        qk = cpu_fused.rotary(qkv, cos, sin, rotated)
        out = torch.ops.brook.attention(qk[:, :heads], qk[:, heads:], qkv[:, rotated:], scale)
        attended = torch.ops.brook.linear(out.reshape(tokens, q_size), 1, hidden)
        if spec.reduce:
            attended = torch.ops.brook.all_reduce(attended)
        normed, x = cpu_fused.add_rms_norm(x, attended, norm2, eps)
        gate_up = torch.ops.brook.linear(normed, 2, 2 * inter)
        mlp = torch.ops.brook.linear(cpu_fused.silu_mul(gate_up), 3, hidden)
        if spec.reduce:
            mlp = torch.ops.brook.all_reduce(mlp)
        return x, mlp

    # The traced graph would carry the (string) return annotation as a global, which the
    # compiler's artifact cache cannot key on: it would then keep no artifact.
    run.__annotations__.pop("return", None)
    return run


def example_inputs(spec: LayerSpec, tokens: int) -> list[torch.Tensor]:
    """Inputs of the layer graph for ``tokens`` rows (zeros: their values do not matter)."""
    dtype, device = spec.torch_dtype, torch.device(spec.device)

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    return [
        zeros(tokens, spec.hidden),
        zeros(tokens, spec.hidden),
        zeros(tokens, 1, spec.head_dim),
        zeros(tokens, 1, spec.head_dim),
        zeros(spec.hidden),
        zeros(spec.hidden),
    ]


def trace(spec: LayerSpec, tokens: int) -> torch.fx.GraphModule:
    """The layer's ATen graph at ``tokens`` rows (shapes from the custom ops' shape
    functions: nothing runs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    assert ops.PARTS  # the custom ops are registered by importing ops
    with cpu_fused.portable():
        graph: torch.fx.GraphModule = make_fx(layer_function(spec), tracing_mode="fake")(
            *example_inputs(spec, tokens)
        )
    return graph


def compile_layer(spec: LayerSpec, tokens: int, folder: Path | None = None) -> LayerGraph:
    """The layer compiled for ``tokens`` rows by the device's graph compiler; with
    ``folder``, its artifact is loaded from there when present and saved there when not."""
    if spec.device == "npu":
        return _npu_backend()(trace(spec, tokens), example_inputs(spec, tokens))  # type: ignore[no-any-return]
    import torch._inductor
    from torch._inductor.standalone_compile import CompiledArtifact

    path = None if folder is None else folder / f"layer-{tokens}.bin"
    if path is not None and path.exists():
        try:
            return CompiledArtifact.load(path=str(path), format="binary")
        except Exception as exc:
            log.warning(
                "compile cache: %s is unreadable (%s); compiling it again",
                path.name,
                type(exc).__name__,
            )
            path.unlink(missing_ok=True)
    from torch._inductor import config as inductor_config

    # eager's roundings: a 16-bit value is rounded where eager rounds it
    with inductor_config.patch(emulate_precision_casts=True):
        artifact = torch._inductor.standalone_compile(
            trace(spec, tokens),
            example_inputs(spec, tokens),  # type: ignore[arg-type]
            dynamic_shapes="from_example_inputs",
        )
    if path is not None:
        partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        artifact.save(path=str(partial), format="binary")
        partial.replace(path)  # whole or absent: another process may be reading
    return artifact


def _npu_backend() -> Callable[..., Any]:
    import torchair  # type: ignore[import-not-found]  # Ascend only

    config = torchair.CompilerConfig()
    return torchair.get_npu_backend(compiler_config=config)  # type: ignore[no-any-return]


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (dimension 0)."""
    extra = rows - t.shape[0]
    if extra == 0:
        return t
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, extra))
