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

from brook_engine.kv_cache import LayerKVCache


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
    decode_slots: torch.Tensor | None = None  # [decodes, max_context] (padding repeats slot 0)
    decode_mask: torch.Tensor | None = None  # [decodes, 1, 1, max_context] bool
    prefills: list[PrefillSpan] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    cache.write(meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    if meta.num_decodes:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        n = meta.num_decodes
        ck, cv = cache.read(meta.decode_slots)  # [decodes, context, kv_heads, head_dim]
        out[:n] = F.scaled_dot_product_attention(
            q[:n].unsqueeze(2),  # [decodes, heads, 1, head_dim]
            ck.transpose(1, 2),
            cv.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=scale,
            enable_gqa=gqa,
        ).squeeze(2)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        if span.slots is None:
            ck, cv = k[rows], v[rows]
        else:
            ck, cv = cache.read(span.slots)
        out[rows] = (
            F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),  # [1, heads, new, head_dim]
                ck.transpose(0, 1).unsqueeze(0),
                cv.transpose(0, 1).unsqueeze(0),
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            .squeeze(0)
            .transpose(0, 1)
        )
    return out
