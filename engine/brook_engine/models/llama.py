"""The Llama-family decoder (Llama, Mistral, Qwen2): pre-norm blocks of grouped-query
attention and a SiLU-gated MLP. q/k/v and gate/up are fused into one projection each, so a
layer runs four matrix multiplications."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from brook_engine.kv_cache import LayerKVCache
from brook_engine.layers.attention import AttentionMetadata, paged_attention
from brook_engine.layers.norm import RMSNorm
from brook_engine.layers.rotary import RotaryEmbedding, apply_rotary
from brook_engine.models.arch import ModelArch

#: cos and sin of the step's positions, [tokens, 1, head_dim] each
Rotary = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias, dtype=dtype)
        self.scale = arch.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project(x, rotary)
        out = paged_attention(q, k, v, cache, meta, self.scale)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))  # type: ignore[no-any-return]

    def project(
        self, x: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both rotated) and values: [tokens, heads or kv_heads, head_dim]."""
        tokens = x.shape[0]
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = self.qkv_proj(x).view(tokens, heads, self.head_dim)
        rotated = self.num_heads + self.num_kv_heads  # q and k heads are adjacent
        qk = apply_rotary(qkv[:, :rotated], *rotary)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, rotated:]


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate = arch.intermediate_size
        self.gate_up_proj = nn.Linear(
            arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias, dtype=dtype
        )
        self.down_proj = nn.Linear(
            arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = MLP(arch, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]


class Decoder(nn.Module):
    """Embedding, the decoder layers and the final norm."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.model = Decoder(arch, dtype)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        rotary: RotaryEmbedding,
        caches: list[LayerKVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [tokens, hidden]
        cos_sin = rotary.lookup(positions)
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x = layer(x, cos_sin, cache, meta)
        return self.model.norm(x)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[sequences, hidden] → float32 logits [sequences, vocab]."""
        return self.lm_head(hidden).float()  # type: ignore[no-any-return]
