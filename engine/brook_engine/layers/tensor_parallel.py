"""What one tensor-parallel rank holds of a layer, and the vocabulary-parallel embedding and
LM head.

Column-parallel projections (q/k/v, gate/up) keep a contiguous slice of output rows per
rank; row-parallel ones (o, down) the matching slice of input columns, and their partial
outputs are summed with an all-reduce. KV heads split across ranks, or are replicated when
there are more ranks than KV heads (each rank then keeps the one head its query heads use).
The vocabulary splits into equal slices (the last one padded with zero rows), so the
embedding is a masked lookup plus an all-reduce and the LM head an all-gather of logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from brook_engine.layers.linear import one_row_linear


class TensorComm(Protocol):
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Shard:
    """This rank's part of the model: its tensor-parallel slice and its pipeline stage."""

    tp_rank: int = 0
    tp_size: int = 1
    layer_start: int = 0
    layer_end: int | None = None  # None: every layer
    first_stage: bool = True
    last_stage: bool = True

    def split(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal slice of ``total`` (which it divides)."""
        size = total // self.tp_size
        return self.tp_rank * size, (self.tp_rank + 1) * size

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """[start, end) of the KV heads this rank keeps."""
        if num_kv_heads >= self.tp_size:
            return self.split(num_kv_heads)
        # More ranks than KV heads: keep the head this rank's query heads attend with.
        first_query_head = self.tp_rank * (num_heads // self.tp_size)
        head = first_query_head // (num_heads // num_kv_heads)
        return head, head + 1

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, end, rows) of this rank's vocabulary slice; rows includes padding."""
        rows = -(-vocab_size // self.tp_size)
        start = self.tp_rank * rows
        return start, min(vocab_size, start + rows), rows


class _VocabSlice(nn.Module):
    """This rank's rows of a [vocabulary, hidden] table, padded to an equal share."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        shard: Shard,
        comm: TensorComm | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.start, self.end, rows = shard.vocab(vocab_size)
        self.comm = comm if shard.tp_size > 1 else None
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype))


class VocabParallelEmbedding(_VocabSlice):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.end)
        local = torch.where(inside, ids - self.start, 0)
        out = F.embedding(local, self.weight) * inside[:, None].to(self.weight.dtype)
        return self.comm.all_reduce(out)


class VocabParallelHead(_VocabSlice):
    """The LM head over this rank's vocabulary slice; ``logits`` gathers the full row."""

    one_row: torch.Tensor | None = None  # 16-bit copy for one-row products (layers.linear)
    packed: torch.Tensor | None = None  # packed copy of a tied table (layers.linear)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # W8A16: an int8 copy of the head (quant.linear). Set here, not on the class: a
        # class attribute would shadow the submodule nn.Module registers on assignment.
        self.quantized: nn.Module | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor
        if self.quantized is not None:
            logits = self.quantized(hidden)
        else:
            weight = self.weight if self.packed is None else self.packed
            # A tied head's table is plain beside its packed copy: one row reads the table.
            one_row = self.one_row
            if one_row is None and self.packed is not None:
                one_row = self.weight
            logits = one_row_linear(hidden, weight, None, one_row)
        if self.comm is None:
            return logits
        return self.comm.all_gather_last_dim(logits)[:, : self.vocab_size]
