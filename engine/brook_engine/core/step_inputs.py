"""A step's sequences as the tensors the decoder takes: token ids, positions, the KV slot of
every new token, the attention metadata (decodes over their block tables, prefill spans with
the mask a chunk after cached tokens needs) and the rows that sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brook_engine.core.sequence import Sequence
from brook_engine.layers.attention import AttentionMetadata, PrefillSpan
from brook_engine.parallel.plan import SeqChunk


@dataclass
class StepInputs:
    chunks: list[SeqChunk]
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    meta: AttentionMetadata
    last_rows: torch.Tensor  # [samplers] the row of each sampling chunk's last token
    samplers: list[int]  # indexes into ``chunks`` that sample

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def chunk_of(seq: Sequence, num_new: int) -> SeqChunk:
    """``seq``'s next ``num_new`` tokens as a step's chunk (it samples if it reaches the end)."""
    start = seq.num_computed_tokens
    end = start + num_new
    samples = end == seq.num_tokens
    return SeqChunk(
        seq.request_id,
        seq.token_ids[start:end],
        start,
        list(seq.block_table),
        samples,
        seq.params if samples else None,
    )


def offsets(inputs: list[StepInputs]) -> list[int]:
    """Where each micro-batch's chunks start in the step's concatenated chunk order."""
    out, at = [], 0
    for step in inputs:
        out.append(at)
        at += len(step.chunks)
    return out


class StepInputBuilder:
    """Turns chunks into ``StepInputs`` on one device for one cache layout."""

    def __init__(self, block_size: int, sliding_window: int | None, device: torch.device):
        self.block_size = block_size
        self.window = sliding_window
        self.device = device

    def build(self, chunks: list[SeqChunk]) -> StepInputs:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        samplers: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for j, chunk in enumerate(chunks):
            start, end, n = chunk.start, chunk.end, len(chunk.token_ids)
            row = len(ids)
            ids.extend(chunk.token_ids)
            pos.extend(range(start, end))
            slots.extend(self._slots(chunk.block_table, start, end))
            if chunk.samples:
                last_rows.append(row + n - 1)
                samplers.append(j)
            if n == 1:
                decode_tables.append(chunk.block_table)
                decode_lens.append(end)
            else:
                prefills.append(self._prefill_span(chunk, row))
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            prefills=prefills,
        )
        if decode_lens:
            self._decode_metadata(meta, decode_tables, decode_lens)
        return StepInputs(
            chunks,
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(pos, dtype=torch.long, device=device),
            meta,
            torch.tensor(last_rows, dtype=torch.long, device=device),
            samplers,
        )

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]

    def _prefill_span(self, chunk: SeqChunk, row: int) -> PrefillSpan:
        start, end, window = chunk.start, chunk.end, self.window
        n = end - start
        if start == 0 and (window is None or end <= window):
            return PrefillSpan(row, n, end, None, None)  # a fresh prompt: plain causal
        keys = torch.arange(end, device=self.device)
        queries = torch.arange(start, end, device=self.device)[:, None]
        mask = keys[None, :] <= queries
        if window is not None:
            mask &= keys[None, :] > queries - window
        slots = torch.tensor(self._slots(chunk.block_table, 0, end), device=self.device)
        return PrefillSpan(row, n, end, slots, mask)

    def _decode_metadata(
        self, meta: AttentionMetadata, tables: list[list[int]], lens: list[int]
    ) -> None:
        size, window, device = self.block_size, self.window, self.device
        width = max(len(t) for t in tables)
        padded = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device
        )
        lengths = torch.tensor(lens, device=device)[:, None]
        keys = torch.arange(width * size, device=device)[None, :]
        mask = keys < lengths
        if window is not None:
            mask &= keys >= lengths - window
        meta.num_decodes = len(tables)
        meta.decode_blocks = padded
        meta.decode_lens = lengths[:, 0]
        meta.sliding_window = window
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        meta.decode_bias = bias.masked_fill_(~mask, float("-inf"))[:, None, None, :]
