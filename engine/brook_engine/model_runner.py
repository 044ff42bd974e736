"""Loads the model and its KV cache onto the device and runs one scheduled batch per step:
flatten the batch into token, position and slot tensors, run the decoder, sample."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch

from brook_engine.config import EngineConfig
from brook_engine.device import Backend
from brook_engine.kv_cache import LayerKVCache, bytes_per_token
from brook_engine.kv_calibration import Calibration, decide, summarize
from brook_engine.layers.attention import AttentionMetadata, PrefillSpan
from brook_engine.layers.rotary import RotaryEmbedding
from brook_engine.layers.sampler import SampleResult, sample
from brook_engine.models.arch import ModelArch
from brook_engine.models.llama import CausalLM
from brook_engine.models.loader import load_weights
from brook_engine.sampling_params import SamplingParams
from brook_engine.scheduler import ScheduledBatch
from brook_engine.sequence import Sequence

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        folder: Path,
        arch: ModelArch,
        backend: Backend,
        progress: bool,
        calibration_ids: list[int] | None = None,
    ) -> None:
        self.config = config
        self.arch = arch
        self.backend = backend
        self.device = backend.device
        dtype_name = config.model.dtype
        self.dtype = backend.default_dtype() if dtype_name == "auto" else _DTYPES[dtype_name]
        self.max_model_len = config.model.max_model_len or arch.max_position_embeddings
        self.block_size = config.kv_cache.block_size

        started = time.perf_counter()
        with torch.device("meta"):
            model = CausalLM(arch, self.dtype)
        model.to_empty(device=self.device)
        if arch.tie_word_embeddings:  # to_empty gives each use of a shared tensor its own copy
            model.lm_head.weight = model.model.embed_tokens.weight
        load_weights(model, folder, progress=progress)
        self.model = model.eval()
        self.load_seconds = time.perf_counter() - started
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

        self.rotary = RotaryEmbedding(
            arch.head_dim,
            self.max_model_len,
            arch.rope_theta,
            arch.rope_type,
            arch.rope_scaling,
            self.dtype,
            self.device,
        )
        self.layer_kinds = config.kv_cache.layer_dtypes(arch.num_layers)
        self.calibration: Calibration | None = None
        dynamic = config.kv_cache.dynamic_precision
        if dynamic.enabled and calibration_ids:
            self.calibration = self._calibrate(calibration_ids)
            self.layer_kinds = self.calibration.chosen
            log.info("%s", summarize(self.calibration))
        self.num_blocks = self._num_blocks()
        self.caches = [
            LayerKVCache.allocate(
                self.num_blocks,
                self.block_size,
                arch.num_kv_heads,
                arch.head_dim,
                kind,
                self.dtype,
                self.device,
            )
            for kind in self.layer_kinds
        ]
        if self.calibration is not None:
            for cache, shift in zip(self.caches, self.calibration.shifts, strict=True):
                cache.k_shift = shift
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def _calibrate(self, token_ids: list[int]) -> Calibration:
        """Measure each low-precision layer's attention error on ``token_ids`` (one prefill
        with exact KV) and choose its storage dtype; see ``kv_calibration``."""
        dynamic = self.config.kv_cache.dynamic_precision
        ids = token_ids[: min(len(token_ids), self.max_model_len, 1024)]
        size = self.block_size
        blocks = -(-len(ids) // size)
        self.caches = [
            LayerKVCache.allocate(
                blocks, size, self.arch.num_kv_heads, self.arch.head_dim, "auto", self.dtype,
                self.device,
            )
            for _ in self.layer_kinds
        ]  # fmt: skip
        seq = Sequence("kv-calibration", list(ids), len(ids), SamplingParams())
        seq.block_table = list(range(blocks))
        layers: list[Any] = [layer.self_attn for layer in self.model.model.layers]
        captured: list[Any] = [None] * len(layers)

        def capture(index: int, _module: Any, args: tuple[Any, ...]) -> None:
            captured[index] = (args[0], args[1])

        hooks = [
            attn.register_forward_pre_hook(functools.partial(capture, i))
            for i, attn in enumerate(layers)
        ]
        try:
            input_ids, positions, meta, _, _ = self._prepare([seq], [len(ids)])
            self.model(input_ids, positions, self.rotary, self.caches, meta)
        finally:
            for hook in hooks:
                hook.remove()
            self.caches = []
        chosen, errors, shifts = decide(
            layers,
            captured,
            list(self.layer_kinds),
            self.dtype,
            dynamic.sensitivity_threshold,
            dynamic.fallback_dtype,
        )
        return Calibration(list(self.layer_kinds), chosen, errors, shifts, len(ids))

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(
            bytes_per_token(kind, self.dtype, self.arch.num_kv_heads, self.arch.head_dim)
            for kind in self.layer_kinds
        )

    def kv_bytes_by_dtype(self, num_blocks: int) -> dict[str, int]:
        """Bytes ``num_blocks`` blocks take in the layers of each storage dtype."""
        out: dict[str, int] = {}
        for kind in self.layer_kinds:
            per_token = bytes_per_token(
                kind, self.dtype, self.arch.num_kv_heads, self.arch.head_dim
            )
            name = str(self.dtype).removeprefix("torch.") if kind == "auto" else kind
            out[name] = out.get(name, 0) + per_token * num_blocks * self.block_size
        return out

    def _num_blocks(self) -> int:
        kv = self.config.kv_cache
        max_seq = kv.max_seq_len or self.max_model_len
        blocks_per_seq = -(-max_seq // self.block_size)
        if kv.num_blocks is not None:
            return kv.num_blocks
        fraction = kv.effective_memory_fraction or 0.9
        budget = self.backend.kv_cache_budget()
        budget_blocks = int(budget * fraction) // (self.kv_bytes_per_token * self.block_size)
        # No point holding more than every sequence slot at full length needs.
        enough = self.config.scheduler.max_num_seqs * blocks_per_seq
        return max(1, min(budget_blocks, enough))

    def memory_bytes(self) -> dict[str, int]:
        """Device memory by kind: weights, KV cache, and activations (the allocator's peak
        beyond the two on accelerators; on CPU, which has no allocator statistics, an
        estimate of the largest step the scheduler allows)."""
        kv = sum(
            t.numel() * t.element_size()
            for c in self.caches
            for t in (c.k, c.v, c.k_scale, c.v_scale)
            if t is not None
        )
        peak = self.backend.peak_allocated()
        if peak is not None:
            activations = max(0, peak - self.weight_bytes - kv)
        else:
            a = self.arch
            tokens = self.config.scheduler.max_num_batched_tokens
            per_token = 4 * a.hidden_size + (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
            per_token += 3 * a.intermediate_size  # gate_up output and its product
            itemsize = torch.empty((), dtype=self.dtype).element_size()
            logits = self.config.scheduler.max_num_seqs * a.vocab_size * 4  # float32
            activations = tokens * per_token * itemsize + logits
        return {"weights": self.weight_bytes, "kv_cache": kv, "activations": activations}

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[SampleResult | None]:
        """Run one step; per sequence the sampled token, or None for a prefill chunk that
        leaves more of the prompt to compute."""
        order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1)
        seqs = [batch.seqs[i] for i in order]
        counts = [batch.num_new_tokens[i] for i in order]
        input_ids, positions, meta, last_rows, samplers = self._prepare(seqs, counts)
        hidden = self.model(input_ids, positions, self.rotary, self.caches, meta)
        results: list[SampleResult | None] = [None] * len(batch)
        if samplers:
            logits = self.model.compute_logits(hidden[last_rows])
            params = [seqs[j].params for j in samplers]
            generators = [self._generator(seqs[j]) for j in samplers]
            sampled = sample(logits, params, generators)
            for row, j in enumerate(samplers):
                results[order[j]] = SampleResult([sampled.token_ids[row]], [sampled.logprobs[row]])
        return results

    @torch.inference_mode()
    def all_logits(self, seq: Sequence) -> torch.Tensor:
        """Logits of every token of ``seq`` computed as one prefill ([tokens, vocab])."""
        input_ids, positions, meta, _, _ = self._prepare([seq], [seq.num_tokens])
        hidden = self.model(input_ids, positions, self.rotary, self.caches, meta)
        return self.model.compute_logits(hidden)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.is_greedy:
            return None
        generator = self.generators.get(seq.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self.generators[seq.request_id] = generator
        return generator

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]

    def _prepare(
        self, seqs: list[Sequence], counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        samplers: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        window = self.arch.sliding_window
        for j, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            row = len(ids)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(self._slots(seq.block_table, start, end))
            if end == seq.num_tokens:
                last_rows.append(row + n - 1)
                samplers.append(j)
            if n == 1:
                decode_tables.append(seq.block_table)
                decode_lens.append(end)
            else:
                prefills.append(self._prefill_span(seq, row, start, end, window))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            prefills=prefills,
        )
        if decode_lens:
            self._decode_metadata(meta, decode_tables, decode_lens, window)
        device = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(pos, dtype=torch.long, device=device),
            meta,
            torch.tensor(last_rows, dtype=torch.long, device=device),
            samplers,
        )

    def _prefill_span(
        self, seq: Sequence, row: int, start: int, end: int, window: int | None
    ) -> PrefillSpan:
        n = end - start
        if start == 0 and (window is None or end <= window):
            return PrefillSpan(row, n, end, None, None)  # a fresh prompt: plain causal
        keys = torch.arange(end, device=self.device)
        queries = torch.arange(start, end, device=self.device)[:, None]
        mask = keys[None, :] <= queries
        if window is not None:
            mask &= keys[None, :] > queries - window
        slots = torch.tensor(self._slots(seq.block_table, 0, end), device=self.device)
        return PrefillSpan(row, n, end, slots, mask)

    def _decode_metadata(
        self,
        meta: AttentionMetadata,
        tables: list[list[int]],
        lens: list[int],
        window: int | None,
    ) -> None:
        size = self.block_size
        width = max(len(t) for t in tables)
        padded = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device
        )
        lengths = torch.tensor(lens, device=self.device)[:, None]
        keys = torch.arange(width * size, device=self.device)[None, :]
        mask = keys < lengths
        if window is not None:
            mask &= keys >= lengths - window
        meta.num_decodes = len(tables)
        meta.decode_blocks = padded
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=self.device)
        meta.decode_bias = bias.masked_fill_(~mask, float("-inf"))[:, None, None, :]
