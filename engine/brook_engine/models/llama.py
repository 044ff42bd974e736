"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) and its mixture-of-experts kin
(Mixtral, Qwen2-MoE, Qwen3-MoE): pre-norm blocks of grouped-query attention (Qwen3's with
per-head q/k RMSNorm) and a SiLU-gated MLP, or an expert block (``layers.moe``) in its place.
q/k/v and gate/up are fused into one projection each, so a dense layer runs four matrix
multiplications.

Under tensor parallelism a rank builds the same modules with its share of the heads and of
the MLP width (``layers.tensor_parallel``); under pipeline parallelism only its stage's
layers, the embedding on the first stage and the final norm and LM head on the last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from brook_engine.config import MoEConfig
from brook_engine.kv.cache import LayerKVCache
from brook_engine.layers import cpu_fused
from brook_engine.layers.attention import AttentionMetadata, paged_attention
from brook_engine.layers.linear import Linear, dense
from brook_engine.layers.moe import ExpertLoad, Routing, SparseMoE
from brook_engine.layers.norm import RMSNorm
from brook_engine.layers.rotary import RotaryEmbedding
from brook_engine.layers.tensor_parallel import (
    Shard,
    TensorComm,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from brook_engine.models.arch import ModelArch
from brook_engine.models.decode_row import RowDecoding, RowStep
from brook_engine.quant.linear import W8A16, Int8Linear, QuantizedHead

if TYPE_CHECKING:
    from brook_engine.offload.state import OffloadState

#: cos and sin of the step's positions, [tokens, 1, head_dim] each
Rotary = tuple[torch.Tensor, torch.Tensor]


class LayerStreamer(Protocol):
    """Weight offload's hooks around each of the stage's layers (``offload.streamer``)."""

    def before_layer(self, layer: int) -> None: ...

    def after_layer(self, layer: int) -> None: ...


#: Runs one layer: (index, layer, its KV cache, residual, delta) -> (residual, delta).
LayerRun = Callable[
    [int, Any, LayerKVCache, torch.Tensor, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor],
]


class StageGraphs(Protocol):
    """Compile mode's graphs of the stage's layers (``compile.graphs.CompiledLayers``)."""

    def run(
        self,
        model: CausalLM,
        x: torch.Tensor,
        cos_sin: Rotary,
        caches: list[LayerKVCache],
        meta: AttentionMetadata,
        row: RowStep | None = None,
    ) -> torch.Tensor | None: ...

    def close(self) -> None: ...


class Reduction(Protocol):
    """An all-reduce in flight."""

    def wait(self) -> torch.Tensor: ...


def make_linear(
    in_features: int, out_features: int, bias: bool, dtype: torch.dtype, int8: W8A16 | None
) -> nn.Module:
    """A projection: float (``Linear``) or W8A16 (``Int8Linear``)."""
    if int8 is not None:
        return Int8Linear(in_features, out_features, bias, dtype, int8.group_for(in_features))
    return Linear(in_features, out_features, bias=bias, dtype=dtype)


class Attention(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        shard: Shard,
        comm: TensorComm | None,
        int8: W8A16 | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = arch.num_heads // shard.tp_size
        kv_start, kv_end = shard.kv_heads(arch.num_heads, arch.num_kv_heads)
        self.num_kv_heads = kv_end - kv_start
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        self.qkv_proj = make_linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, arch.qkv_bias, dtype, int8
        )
        self.o_proj = make_linear(self.q_size, arch.hidden_size, arch.o_bias, dtype, int8)
        self.scale = arch.head_dim**-0.5
        self.comm = comm if shard.tp_size > 1 else None
        # Qwen3: each head's queries and keys RMS-normed over head_dim before the rotation
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        reduce: bool = True,
    ) -> torch.Tensor:
        """The attention output; this rank's partial sum when ``reduce`` is False."""
        q, k, v = self.project(x, rotary)
        out = paged_attention(q, k, v, cache, meta, self.scale)
        out = self.o_proj(out.reshape(x.shape[0], self.q_size))
        return out if self.comm is None or not reduce else self.comm.all_reduce(out)

    def project(
        self, x: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both rotated) and values: [tokens, heads or kv_heads, head_dim]."""
        tokens = x.shape[0]
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = self.qkv_proj(x).view(tokens, heads, self.head_dim)
        rotated = self.num_heads + self.num_kv_heads  # q and k heads are adjacent
        if self.q_norm is not None and self.k_norm is not None:
            for norm, start, end in (
                (self.q_norm, 0, self.num_heads),
                (self.k_norm, self.num_heads, rotated),
            ):
                part = qkv[:, start:end].reshape(-1, self.head_dim)
                qkv[:, start:end] = norm(part).view(tokens, end - start, self.head_dim)
        qk = cpu_fused.rotary(qkv, *rotary, rotated)  # on CPU in place: qkv is ours alone
        return qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, rotated:]


class MLP(nn.Module):
    """A SiLU-gated MLP ``width`` wide on this rank: a dense layer's column/row-parallel
    slice (its output all-reduced over ``comm``), a whole expert, or a shared expert's slice."""

    def __init__(
        self,
        hidden_size: int,
        width: int,
        bias: bool,
        dtype: torch.dtype,
        comm: TensorComm | None,
        int8: W8A16 | None = None,
    ) -> None:
        super().__init__()
        self.intermediate = width
        self.gate_up_proj = make_linear(hidden_size, 2 * width, bias, dtype, int8)
        self.down_proj = make_linear(width, hidden_size, bias, dtype, int8)
        self.comm = comm

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        out = self.down_proj(cpu_fused.silu_mul(self.gate_up_proj(x)))
        return out if self.comm is None or not reduce else self.comm.all_reduce(out)


def routing_for(arch: ModelArch, moe: MoEConfig | None) -> Routing | None:
    """The router's rule for ``arch`` (None for a dense model) with the ``moe`` settings."""
    experts = arch.experts
    if experts is None:
        return None
    moe = moe or MoEConfig()
    return Routing(
        num_experts=experts.num_experts,
        top_k=moe.top_k or experts.experts_per_token,
        normalize=experts.normalize_top_k,
        weights_in_model_dtype=arch.architecture != "MixtralForCausalLM",
        reroute=moe.reroute,
        threshold=moe.load_threshold,
    )


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        shard: Shard,
        comm: TensorComm | None,
        int8: W8A16 | None = None,
        index: int = 0,
        routing: Routing | None = None,
    ) -> None:
        """``index``: the layer's place in the whole model; ``routing``: the router's rule
        where the model has experts."""
        super().__init__()
        h = arch.hidden_size
        self.input_layernorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, dtype, shard, comm, int8)
        self.post_attention_layernorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        reduce_over = comm if shard.tp_size > 1 else None
        self.mlp: MLP | SparseMoE
        if routing is not None and arch.is_sparse(index) and arch.experts is not None:
            self.mlp = SparseMoE(
                h,
                arch.experts.expert_size,
                arch.experts.shared_expert_size,
                routing,
                index,
                dtype,
                shard,
                reduce_over,
                lambda width, over: MLP(h, width, False, dtype, over, int8),
            )
        else:
            width = arch.intermediate_size // shard.tp_size
            self.mlp = MLP(h, width, arch.mlp_bias, dtype, reduce_over, int8)
        # Brook's one-row decode kernel runs the dense Llama layer (models.decode_row)
        self.row_kernel = isinstance(self.mlp, MLP) and not arch.qk_norm

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rotary: Rotary,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``x`` plus the previous layer's output ``delta`` (None on a
        stage's first layer) through this layer: ``(residual, this layer's MLP output)``.
        Each residual add is fused with the RMSNorm that follows it, so the MLP output is
        handed on and added by the next layer's norm."""
        normed, x = self.input_layernorm.add_norm(x, delta)
        attended = self.self_attn(normed, rotary, cache, meta)
        normed, x = self.post_attention_layernorm.add_norm(x, attended)
        return x, self.mlp(normed)

    def partial(
        self,
        part: int,
        x: torch.Tensor,
        rotary: Rotary,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """This rank's unreduced attention (``part`` 0) or MLP (1) output for residual ``x``."""
        if part == 0:
            normed = self.input_layernorm(x)
            return self.self_attn(normed, rotary, cache, meta, reduce=False)  # type: ignore[no-any-return]
        return self.mlp(self.post_attention_layernorm(x), reduce=False)  # type: ignore[no-any-return]


class Decoder(nn.Module):
    """Embedding (first stage), this stage's decoder layers, the final norm (last stage)."""

    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        shard: Shard,
        comm: TensorComm | None,
        int8: W8A16 | None = None,
        moe: MoEConfig | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, shard, comm, dtype)
            if shard.first_stage
            else None
        )
        end = arch.num_layers if shard.layer_end is None else shard.layer_end
        routing = routing_for(arch, moe)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, dtype, shard, comm, int8, i, routing)
            for i in range(shard.layer_start, end)
        )
        self.norm = (
            RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype) if shard.last_stage else None
        )


class CausalLM(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        shard: Shard | None = None,
        comm: TensorComm | None = None,
        int8: W8A16 | None = None,
        moe: MoEConfig | None = None,
    ) -> None:
        """``int8``: W8A16 projections (``quant.linear``); the embedding, norms, routers and
        the LM head's table stay in ``dtype``. ``moe``: the routing settings of a
        mixture-of-experts model."""
        super().__init__()
        self.arch = arch
        self.shard = shard = shard or Shard()
        self.model = Decoder(arch, dtype, shard, comm, int8, moe)
        # Tokens per expert per layer, as this rank's routers sent them (MoE models)
        self.expert_load: ExpertLoad | None = None
        if arch.experts is not None:
            self.expert_load = ExpertLoad(arch.experts.num_experts, shard.tp_size)
            for layer in self.model.layers:
                if isinstance(layer.mlp, SparseMoE):
                    layer.mlp.load = self.expert_load
        self.lm_head = (
            VocabParallelHead(arch.vocab_size, arch.hidden_size, shard, comm, dtype)
            if shard.last_stage
            else None
        )
        self.tie_embeddings()
        self.row_decoding = RowDecoding()
        # Weight offload (set by the loader): this rank's pieces, tiers and ledger, and the
        # streamer that fills streamed pieces' slots around each layer.
        self.offload: OffloadState | None = None
        self.streamer: LayerStreamer | None = None
        # Compile mode (set by the runner): the layers as compiled graphs per token bucket.
        self.graphs: StageGraphs | None = None

    def tie_embeddings(self) -> None:
        """Share the embedding with the LM head when the model ties them and this rank
        holds both (``to_empty`` gives each use of a shared tensor its own copy, so the
        runner calls this again after it)."""
        embed, head = self.model.embed_tokens, self.lm_head
        if self.arch.tie_word_embeddings and embed is not None and head is not None:
            head.weight = embed.weight

    def forward(
        self,
        inputs: torch.Tensor,  # [tokens] ids on the first stage, else [tokens, hidden]
        positions: torch.Tensor,  # [tokens]
        rotary: RotaryEmbedding,
        caches: list[LayerKVCache],  # this stage's layers
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        embed = self.model.embed_tokens
        x = embed(inputs) if embed is not None else inputs  # [tokens, hidden]
        cos_sin = rotary.lookup(positions)
        delta: torch.Tensor | None = None
        # One token of one sequence on CPU: a layer per kernel call where it can (decode_row).
        row = self.row_decoding.begin(x, meta, cos_sin)
        graphs = self.graphs
        if graphs is not None and (row is None or not row.covers(self.model.layers, caches)):
            # the bucket's graph (the row kernel still runs the layers it covers)
            compiled = graphs.run(self, x, cos_sin, caches, meta, row)
            if compiled is not None:
                return compiled
        x, delta = self.run_layers(
            x, delta, caches, row, lambda _, la, c, h, d: la(h, d, cos_sin, c, meta)
        )
        return self.stage_output(x, delta)

    def run_layers(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        caches: list[LayerKVCache],
        row: RowStep | None,
        run_layer: LayerRun,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's layers over the residual ``x`` and the last output ``delta``: a
        layer the row kernel covers (``row``, one decoding sequence) as one kernel call, the
        others by ``run_layer`` (eager, or compile mode's graph); weight offload's hooks
        around each."""
        streamer = self.streamer
        for i, (layer, cache) in enumerate(zip(self.model.layers, caches, strict=True)):
            if streamer is not None:
                streamer.before_layer(i)
            try:
                done = row.layer(layer, cache, x, delta) if row is not None else None
                x, delta = done if done is not None else run_layer(i, layer, cache, x, delta)
            finally:  # a failing layer still hands its slot back
                if streamer is not None:
                    streamer.after_layer(i)
        return x, delta

    def stage_output(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The residual plus the last layer's output, normed on the last stage."""
        norm = self.model.norm
        if norm is not None:
            return norm.add_norm(x, delta)[0]
        return x if delta is None else x + delta

    def forward_interleaved(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]],
        rotary: RotaryEmbedding,
        caches: list[LayerKVCache],
        reduce_async: Callable[[torch.Tensor], Reduction],
    ) -> list[torch.Tensor]:
        """Several micro-batches (inputs, positions, metadata) layer by layer, so that each
        one's tensor-parallel all-reduce is in flight while the next one computes: attention
        of micro-batch 1 hides the reduction of micro-batch 0's attention, and so on. The
        sums are the same as ``forward``'s, in the same order."""
        embed = self.model.embed_tokens
        xs = [embed(inputs) if embed is not None else inputs for inputs, _, _ in batches]
        rotations = [rotary.lookup(positions) for _, positions, _ in batches]
        pending: list[Reduction | None] = [None] * len(batches)
        streamer = self.streamer
        for i_layer, (layer, cache) in enumerate(zip(self.model.layers, caches, strict=True)):
            if streamer is not None:
                streamer.before_layer(i_layer)
            for part in (0, 1):
                for i, (_, _, meta) in enumerate(batches):
                    reduction = pending[i]
                    if reduction is not None:
                        xs[i] = xs[i] + reduction.wait()
                    out = layer.partial(part, xs[i], rotations[i], cache, meta)  # type: ignore[operator]
                    pending[i] = reduce_async(out)
            if streamer is not None:
                # the reductions still in flight read the layer's outputs, not its weights
                streamer.after_layer(i_layer)
        for i, reduction in enumerate(pending):
            if reduction is not None:
                xs[i] = xs[i] + reduction.wait()
        norm = self.model.norm
        return [norm(x) if norm is not None else x for x in xs]

    def compute_logits(self, hidden: torch.Tensor, in_float32: bool = False) -> torch.Tensor:
        """[sequences, hidden] → float32 logits [sequences, vocab] (last stage only).
        ``in_float32``: the head's product itself in float32 (one process only), so the
        logits carry no 16-bit rounding — measurements compare them without the exact ties
        a bf16 head leaves between close tokens."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        if in_float32:
            assert self.lm_head.comm is None, "a float32 head needs the whole vocabulary here"
            quantized = self.lm_head.quantized
            if isinstance(quantized, QuantizedHead):
                return F.linear(hidden.float(), quantized.dequantized().float())
            return F.linear(hidden.float(), dense(self.lm_head.weight).float())
        return self.lm_head(hidden).float()  # type: ignore[no-any-return]
