"""Attention over the paged KV cache.

Tokens of one step come flattened: first one token per decoding sequence, then the new
tokens of each prefilling sequence. New keys and values are written to their slots first;
decodes then attend over their gathered context in one batched call, and each prefill over
its own context (a fresh prompt uses the causal kernel directly, a chunk after cached tokens
an explicit mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from brook_engine.kv.cache import LayerKVCache
from brook_engine.layers import cpu_decode


@dataclass
class PrefillSpan:
    start: int  # first token of the span in the flattened batch
    num_tokens: int  # new tokens this step
    context_len: int  # tokens in the cache after this step (cached + new)
    slots: torch.Tensor | None  # [context_len] when earlier tokens are cached, else None
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, None for plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] slot each new token's KV is written to
    num_decodes: int = 0
    decode_blocks: torch.Tensor | None = None  # [decodes, max_blocks] (padded with block 0)
    decode_bias: torch.Tensor | None = None  # [decodes, 1, 1, max_context]: 0 or -inf
    decode_lens: torch.Tensor | None = None  # [decodes] context lengths, the new token included
    sliding_window: int | None = None  # keys a query sees, counting itself (None: all)
    prefills: list[PrefillSpan] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    if not cpu_decode.store(cache, meta.slot_mapping, k, v):
        cache.write(meta.slot_mapping, k, v)
    q = cpu_decode.query(cache, q)  # what scores the stored keys (INT8: turned and scaled)
    gqa = q.shape[1] != k.shape[1]
    if meta.num_decodes == q.shape[0] and meta.decode_lens is not None:  # decodes alone
        assert meta.decode_blocks is not None
        fused = cpu_decode.decode_attention(
            q, cache, meta.decode_blocks, meta.decode_lens, scale, meta.sliding_window
        )
        if fused is not None:
            return cpu_decode.output(cache, fused.to(q.dtype))
    out = torch.empty_like(q)
    if meta.num_decodes:
        assert meta.decode_blocks is not None and meta.decode_bias is not None
        n = meta.num_decodes
        fused = (
            None
            if meta.decode_lens is None
            else cpu_decode.decode_attention(
                q[:n], cache, meta.decode_blocks, meta.decode_lens, scale, meta.sliding_window
            )
        )
        if fused is not None:
            out[:n] = fused
        else:
            ck, cv = cache.read_blocks(meta.decode_blocks)  # [kv_heads, decodes, ctx, dim]
            out[:n] = _decode_attention(q[:n], ck, cv, meta.decode_bias, scale)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        if span.slots is None and cache.int8 is not None:
            # Read back what was written: encoding the span alone is a matrix product of
            # another size, which an accelerator's BLAS may round differently.
            ck, cv = cache.read(meta.slot_mapping[rows])
        elif span.slots is None:
            ck, cv = cache.as_stored(k[rows], v[rows])  # [kv_heads, new, head_dim]
        else:
            ck, cv = cache.read(span.slots)  # [kv_heads, context, head_dim]
        out[rows] = (
            F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),  # [1, heads, new, head_dim]
                ck.unsqueeze(0),
                cv.unsqueeze(0),
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            .squeeze(0)
            .transpose(0, 1)
        )
    return cpu_decode.output(cache, out)


def _decode_attention(
    q: torch.Tensor,  # [decodes, heads, head_dim]
    k: torch.Tensor,  # [kv_heads, decodes, context, head_dim]
    v: torch.Tensor,
    bias: torch.Tensor,  # [decodes, 1, 1, context]
    scale: float,
) -> torch.Tensor:
    """One query per sequence: two batched matmuls over (KV head, sequence) with the query
    heads of a group stacked, so keys are neither repeated nor copied (the fused CPU kernel
    is slow for single-query GQA)."""
    decodes, heads, dim = q.shape
    kv_heads, _, context, _ = k.shape
    group = heads // kv_heads
    grouped = q.view(decodes, kv_heads, group, dim).transpose(0, 1)  # [kv, decodes, group, dim]
    scores = torch.matmul(grouped, k.transpose(2, 3)).float() * scale
    scores = scores + bias.view(1, decodes, 1, context)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [kv, decodes, group, context]
    out = torch.matmul(probs, v)  # [kv, decodes, group, dim]
    return out.transpose(0, 1).reshape(decodes, heads, dim)
