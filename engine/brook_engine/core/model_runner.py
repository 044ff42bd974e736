"""Loads the model and its KV cache onto the device and runs one scheduled batch per step:
flatten the batch into token, position and slot tensors, run the decoder, sample.

The same runner runs on every rank of a tensor- or pipeline-parallel replica. Rank 0 turns
the scheduled batch into a step plan and sends it to the others; every rank then runs its
stage over the plan's micro-batches (receiving activations from the stage before, sending
them on asynchronously while it computes the next micro-batch), and the last stage samples
and sends the tokens back to rank 0. A single-process engine is the same code with one rank
and no communication."""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from brook_engine.config import EngineConfig, KVDType
from brook_engine.device import Backend
from brook_engine.kv_cache import LayerKVCache, bytes_per_token
from brook_engine.kv_calibration import (
    Calibration,
    LayerSample,
    calibrate,
    calibration_positions,
    summarize,
)
from brook_engine.layers import cpu_fused
from brook_engine.layers.attention import AttentionMetadata, PrefillSpan
from brook_engine.layers.linear import keep_one_row_copies, pack_cpu_weights
from brook_engine.layers.parallel import Shard
from brook_engine.layers.rotary import RotaryEmbedding
from brook_engine.layers.sampler import SampleResult
from brook_engine.layers.sampler import sample as sample_tokens
from brook_engine.models.arch import ModelArch
from brook_engine.models.llama import CausalLM
from brook_engine.models.loader import load_weights
from brook_engine.parallel.comm import Communicator, Pending, Sent
from brook_engine.parallel.overlap import Adaptation, Counters
from brook_engine.parallel.plan import SeqChunk, StepPlan, split_micro_batches
from brook_engine.parallel.topology import Topology, split_layers, stage_bounds
from brook_engine.sampling_params import SamplingParams
from brook_engine.scheduler import ScheduledBatch
from brook_engine.sequence import Sequence

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


#: Overlap counters are summed at rank 0 every this many steps (one small collective).
REPORT_EVERY_STEPS = 8


def stage_layer_counts(config: EngineConfig, arch: ModelArch) -> list[int]:
    """Layers per pipeline stage: as configured, else balanced by cost, the LM head (and
    sampling) counted against the last stage in units of one decoder layer."""
    par = config.parallel
    if par.stage_layers is not None:
        return list(par.stage_layers)
    h, i = arch.hidden_size, arch.intermediate_size
    layer = h * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    layer += arch.num_heads * arch.head_dim * h + 3 * h * i
    head = h * arch.vocab_size
    return split_layers(arch.num_layers, par.pipeline, 1.0, 0.0, head / layer)


@dataclass
class Flight:
    """A step on its way through the replica: what rank 0 keeps until ``collect``."""

    plan: StepPlan
    started: float
    sends: list[Pending] = field(default_factory=list)
    results: list[SampleResult | None] | None = None  # set where this rank sampled
    tokens: int = 0
    prefill_tokens: int = 0


@dataclass
class _Prepared:
    chunks: list[SeqChunk]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    last_rows: torch.Tensor
    samplers: list[int]  # indexes into ``chunks`` that sample

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


#: Calibration tokens INT8 scales need at least (fewer when the model is shorter).
MIN_INT8_CALIBRATION_TOKENS = 256


def _check_int8_calibration(ids: list[int] | None, max_model_len: int) -> None:
    need = min(MIN_INT8_CALIBRATION_TOKENS, max_model_len)
    have = len(ids or [])
    if have < need:
        raise ValueError(
            f"INT8 KV layers take their scales from calibration text: it gives {have} tokens, "
            f"they need at least {need}; give a longer kvCache.dynamicPrecision."
            "calibrationFile (or leave it unset for the built-in text)"
        )


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        folder: Path,
        arch: ModelArch,
        backend: Backend,
        progress: bool,
        calibration_ids: list[int] | None = None,
        comm: Communicator | None = None,
    ) -> None:
        self.config = config
        self.arch = arch
        self.backend = backend
        self.device = backend.device
        self.comm = comm
        self.topology = comm.topology if comm is not None else Topology.single()
        topo = self.topology
        dtype_name = config.model.dtype
        self.dtype = backend.default_dtype() if dtype_name == "auto" else _DTYPES[dtype_name]
        self.max_model_len = config.model.max_model_len or arch.max_position_embeddings
        self.block_size = config.kv_cache.block_size

        self.stage_layers = stage_layer_counts(config, arch)
        self.layer_start, self.layer_end = stage_bounds(self.stage_layers, topo.stage)
        self.shard = Shard(
            topo.tp_rank,
            topo.tensor,
            self.layer_start,
            self.layer_end,
            topo.is_first_stage,
            topo.is_last_stage,
        )
        started = time.perf_counter()
        with torch.device("meta"):
            model = CausalLM(arch, self.dtype, self.shard, comm)
        model.to_empty(device=self.device)
        model.tie_embeddings()
        load_weights(model, folder, progress=progress and topo.is_driver)
        self.model = model.eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if self.device.type == "cpu":
            self.weight_bytes += pack_cpu_weights(model)
        self.one_row_copies = self._keep_one_row_copies(config.shapes.one_row_weights)
        self.load_seconds = time.perf_counter() - started
        kv_start, kv_end = self.shard.kv_heads(arch.num_heads, arch.num_kv_heads)
        self.num_kv_heads = kv_end - kv_start  # this rank's

        self.rotary = RotaryEmbedding(
            arch.head_dim,
            self.max_model_len,
            arch.rope_theta,
            arch.rope_type,
            arch.rope_scaling,
            self.dtype,
            self.device,
        )
        policy = config.kv_cache.layer_dtypes(arch.num_layers)
        self.layer_kinds: list[KVDType] = policy[self.layer_start : self.layer_end]
        self.calibration: Calibration | None = None
        # Steps in flight at once: a pipeline's first stage starts the next step while the
        # later stages finish this one (each step holds its own sequences).
        self.steps_in_flight = (
            (config.parallel.steps_in_flight or topo.pipeline) if topo.pipeline > 1 else 1
        )
        # Pipeline: with a step per stage in flight the stages are busy already and one
        # micro-batch per step is the start; with fewer steps in flight, micro-batches keep
        # them busy. Either way more micro-batches hide more of each step's sends. Tensor
        # parallel alone: two micro-batches, interleaved, hide the all-reduces; more only
        # shrink the matrix multiplications. One device: nothing to hide.
        pinned = config.parallel.micro_batches
        if topo.pipeline > 1:
            start = 1 if self.steps_in_flight >= topo.pipeline else topo.pipeline
            ceiling = 8 * topo.pipeline
        else:
            start, ceiling = 1, 2 if topo.tensor > 1 else 1
        self.micro_batches = Adaptation(pinned or start, pinned or ceiling)
        self._released: list[str] = []
        # A worker's sends of its last steps, oldest first (see ``run_plan``).
        self._outboxes: deque[list[Pending | Sent]] = deque()
        self._open_flights = 0  # rank 0: steps issued and not collected
        self._last_collected = 0.0
        self._steps = 0
        self.last_plan_time = time.monotonic()
        #: Send activations with blocking calls instead of asynchronously: the baseline
        #: ``brook-engine bench --workload parallel`` compares against.
        self.blocking_sends = False
        # Rank 0: summed over the ranks at the last report, and the window before it.
        self.replica_counters = Counters(stage_compute=[0.0] * topo.pipeline)
        self.window = Counters(stage_compute=[0.0] * topo.pipeline)
        calibrating = config.kv_cache.needs_calibration
        if comm is not None and calibrating:
            calibration_ids = comm.broadcast_object(calibration_ids)
        if "int8" in policy:  # every rank checks the whole policy: all of them stop alike
            _check_int8_calibration(calibration_ids, self.max_model_len)
        if calibrating and calibration_ids:
            self.calibration = self._calibrate(calibration_ids)
            self.layer_kinds = self.calibration.chosen
            if topo.world_size == 1:
                log.info("%s", summarize(self.calibration))
        self.num_blocks = self._num_blocks()
        if comm is not None:  # every rank must hold the same blocks
            self.num_blocks = comm.min_int(self.num_blocks)
        self.caches = [
            LayerKVCache.allocate(
                self.num_blocks,
                self.block_size,
                self.num_kv_heads,
                arch.head_dim,
                kind,
                self.dtype,
                self.device,
            )
            for kind in self.layer_kinds
        ]
        if self.calibration is not None:
            for cache, shift, int8 in zip(
                self.caches, self.calibration.shifts, self.calibration.int8, strict=True
            ):
                cache.k_shift, cache.int8 = shift, int8
        self.generators: dict[str, torch.Generator] = {}
        self._replica = self._gather_replica_facts()

    # -- replica-wide facts (rank 0 reports them) ------------------------------------------

    def _keep_one_row_copies(self, choice: str) -> bool:
        """``shapes.oneRowWeights``: copies of the weights for one-row products, where they
        apply (a bfloat16 model on CPU; BF16 copies need the AVX512-BF16 kernel)."""
        if choice == "model":
            return False
        if self.device.type != "cpu" or self.dtype != torch.bfloat16:
            log.warning(
                "shapes.oneRowWeights %s applies to bfloat16 models on CPU; ignored (%s, %s)",
                choice,
                self.device.type,
                str(self.dtype).removeprefix("torch."),
            )
            return False
        if choice == "bf16" and not cpu_fused.one_row_bf16_supported():
            log.warning(
                "shapes.oneRowWeights bf16 needs a CPU with AVX512-BF16 and Brook's CPU "
                "kernels (see the log above); ignored, use fp16 on this CPU"
            )
            return False
        dtype = torch.bfloat16 if choice == "bf16" else torch.float16
        self.weight_bytes += keep_one_row_copies(self.model, dtype)
        return True

    def _gather_replica_facts(self) -> dict[str, Any]:
        """Per global layer: its KV dtype and calibration error (the highest over the tensor
        ranks, each of which calibrates its own heads); KV bytes per token and weight
        bytes summed over every rank."""
        local = {
            "stage": self.topology.stage,
            "tp_rank": self.topology.tp_rank,
            "kinds": list(self.layer_kinds),
            "errors": list(self.calibration.errors) if self.calibration else None,
            "kv_bytes": self._local_kv_bytes_per_token(),
            "weight_bytes": self.weight_bytes,
        }
        if self.comm is None:
            return local
        everyone = self.comm.gather_object(local)
        if everyone is None:
            return local
        kinds: list[KVDType] = []
        errors: list[float | None] | None = [] if local["errors"] is not None else None
        for stage in range(self.topology.pipeline):
            ranks = [r for r in everyone if r["stage"] == stage]
            kinds += next(r["kinds"] for r in ranks if r["tp_rank"] == 0)
            if errors is not None:
                per_rank = [r["errors"] for r in ranks]
                for layer_errors in zip(*per_rank, strict=True):
                    known = [e for e in layer_errors if e is not None]
                    errors.append(max(known) if known else None)
        if errors is not None and self.calibration is not None:
            log.info(
                "KV calibration over %d ranks: layer dtypes %s, errors %s",
                self.topology.world_size,
                kinds,
                ["-" if e is None else f"{e:.4f}" for e in errors],
            )
        return {
            "kinds": kinds,
            "errors": errors,
            "kv_bytes": sum(r["kv_bytes"] for r in everyone),
            "weight_bytes": sum(r["weight_bytes"] for r in everyone),
        }

    @property
    def replica_layer_kinds(self) -> list[KVDType]:
        return list(self._replica["kinds"])

    @property
    def replica_calibration_errors(self) -> list[float | None]:
        return list(self._replica["errors"] or [])

    # -- calibration -----------------------------------------------------------------------

    @torch.inference_mode()
    def _calibrate(self, token_ids: list[int]) -> Calibration:
        """Measure each low-precision layer's attention error on ``token_ids`` (one prefill
        with exact KV) and choose its storage dtype; see ``kv_calibration``. Under
        parallelism every rank measures its own layers and heads in the same pass."""
        dynamic = self.config.kv_cache.dynamic_precision
        ids = token_ids[: min(len(token_ids), self.max_model_len, 1024)]
        size = self.block_size
        blocks = -(-len(ids) // size)
        self.caches = [
            LayerKVCache.allocate(
                blocks, size, self.num_kv_heads, self.arch.head_dim, "auto", self.dtype,
                self.device,
            )
            for _ in self.layer_kinds
        ]  # fmt: skip
        chunk = SeqChunk("kv-calibration", list(ids), 0, list(range(blocks)), False, None)
        layers: list[Any] = [layer.self_attn for layer in self.model.model.layers]
        captured: list[Any] = [None] * len(layers)

        def capture(index: int, _module: Any, args: tuple[Any, ...]) -> None:
            captured[index] = (args[0], args[1])

        hooks = [
            attn.register_forward_pre_hook(functools.partial(capture, i))
            for i, attn in enumerate(layers)
        ]
        try:
            _, sends = self._run_stage([self._prepare([chunk])], sample=False)
            for pending in sends:
                pending.wait()
        finally:
            for hook in hooks:
                hook.remove()
            self.caches = []
        self._finish_step()
        fit_at, measure_at = calibration_positions(len(ids), self.max_model_len)

        def placed(layer: Any, x: torch.Tensor) -> Callable[[torch.Tensor], Any]:
            return lambda at: layer.project(x, self.rotary.lookup(at.to(self.device)))

        samples = [
            LayerSample(placed(layer, x), fit_at, measure_at, layer.scale)
            for layer, (x, _) in zip(layers, captured, strict=True)
        ]
        # Dynamic precision off: the pass only fits INT8 layers; nothing moves.
        threshold = dynamic.sensitivity_threshold if dynamic.enabled else None
        return calibrate(
            samples, list(self.layer_kinds), self.dtype, threshold, dynamic.fallback_dtype, len(ids)
        )

    # -- memory ----------------------------------------------------------------------------

    def _local_kv_bytes_per_token(self) -> int:
        return sum(
            bytes_per_token(kind, self.dtype, self.num_kv_heads, self.arch.head_dim)
            for kind in self.layer_kinds
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes in the whole replica (every rank's layers and heads)."""
        return int(self._replica["kv_bytes"])

    def kv_bytes_by_dtype(self, num_blocks: int) -> dict[str, int]:
        """Bytes ``num_blocks`` blocks take in this rank's layers of each storage dtype."""
        out: dict[str, int] = {}
        for kind in self.layer_kinds:
            per_token = bytes_per_token(kind, self.dtype, self.num_kv_heads, self.arch.head_dim)
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
        per_block = max(1, self._local_kv_bytes_per_token()) * self.block_size
        budget_blocks = int(budget * fraction) // per_block
        # No point holding more than every sequence slot at full length needs.
        enough = self.config.scheduler.max_num_seqs * blocks_per_seq
        return max(1, min(budget_blocks, enough))

    def memory_bytes(self) -> dict[str, int]:
        """Device memory of this rank by kind: weights, KV cache, and activations (the
        allocator's peak beyond the two on accelerators; on CPU, which has no allocator
        statistics, an estimate of the largest step the scheduler allows)."""
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
            tp = self.topology.tensor
            tokens = self.config.scheduler.max_num_batched_tokens
            per_token = 4 * a.hidden_size + (a.num_heads + 2 * a.num_kv_heads) * a.head_dim // tp
            per_token += 3 * a.intermediate_size // tp  # gate_up output and its product
            itemsize = torch.empty((), dtype=self.dtype).element_size()
            logits = self.config.scheduler.max_num_seqs * a.vocab_size * 4  # float32
            activations = tokens * per_token * itemsize + logits
        return {"weights": self.weight_bytes, "kv_cache": kv, "activations": activations}

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        if self.comm is not None and not self.topology.is_sampler:
            self._released.append(request_id)

    # -- the step (rank 0) -----------------------------------------------------------------

    @torch.inference_mode()
    def issue(self, batch: ScheduledBatch) -> Flight:
        """Start a step: send its plan to the other ranks and run this rank's stage. In a
        pipeline it returns while the later stages still work on it (``collect`` takes its
        tokens), so the next step's first stage can run meanwhile."""
        chunks = [_chunk(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
        started = time.perf_counter()
        self._open_flights += 1
        if self.comm is None:
            return self._start(StepPlan("step", chunks, 1), started)
        self._steps += 1
        plan = StepPlan(
            "step",
            chunks,
            self.micro_batches.micro_batches,
            self._released,
            report=self._steps % REPORT_EVERY_STEPS == 0,
            blocking_sends=self.blocking_sends,
        )
        self._released = []
        self.comm.send_plan(plan, keep=self.steps_in_flight)
        self.last_plan_time = time.monotonic()
        return self._start(plan, started)

    @torch.inference_mode()
    def collect(self, flight: Flight) -> list[SampleResult | None]:
        """Wait for a step ``issue`` started; per sequence in the batch's order its sampled
        token, or None for a prefill chunk that leaves more of the prompt to compute."""
        topo, comm = self.topology, self.comm
        results = flight.results
        if flight.plan.chunks:
            self._open_flights -= 1
        if comm is not None and flight.plan.chunks and topo.sampler_rank != 0:
            results = comm.recv_object(topo.sampler_rank)
        for pending in flight.sends:
            pending.wait()
        wall = 0.0
        if flight.plan.chunks:  # busy time: overlapping steps count once
            now = time.perf_counter()
            wall = now - max(flight.started, self._last_collected)
            self._last_collected = now
        self._finish_step(wall, flight.plan.report, flight.tokens, flight.prefill_tokens)
        assert results is not None or not flight.plan.chunks
        return results or []

    def flush_counters(self) -> Counters:
        """Rank 0, nothing in flight: sum every rank's overlap counters now (not only every
        few steps)."""
        if self._open_flights:
            raise RuntimeError("flush_counters needs every step collected first")
        if self.comm is not None:
            plan = StepPlan("step", report=True, blocking_sends=self.blocking_sends)
            self.comm.send_plan(plan, keep=self.steps_in_flight)
            self.collect(self._start(plan, time.perf_counter()))
        return self.replica_counters

    def heartbeat(self) -> None:
        """Tell the other ranks the replica is alive while it has nothing to run (their
        wait for the next plan would otherwise time out)."""
        if self.comm is not None:
            plan = StepPlan("heartbeat", released=self._released)
            self._released = []
            self.comm.send_plan(plan, keep=self.steps_in_flight)
            self.last_plan_time = time.monotonic()

    def shutdown(self) -> None:
        """Rank 0: let the other ranks exit; every rank: leave the group."""
        if self.comm is None:
            return
        if self.topology.is_driver:
            try:
                self.comm.send_plan(StepPlan("stop"), keep=self.steps_in_flight)
                self.comm.drain_plans(self.config.parallel.timeout_seconds)
            except RuntimeError as exc:  # some rank already gone: nothing to tell it
                log.debug("stop plan not delivered: %s", exc)
        else:
            try:
                self._drain_outboxes(keep=0)
            except RuntimeError as exc:  # rank 0 already gone
                log.debug("last messages not delivered: %s", exc)
        self.comm.close()

    # -- the step (every rank) -------------------------------------------------------------

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> None:
        """A rank other than 0: run this rank's part of a step. The last stage's sampler
        sends the tokens to rank 0, and on a report step every rank its counters.

        Nothing here waits for the step's own sends: rank 0 takes step k's tokens and
        counters only after it issued step k + stepsInFlight - 1, which needs this rank
        (a tensor-parallel peer's all-reduce, a stage's activations). So a rank waits for a
        step's sends only once it has run that later step too."""
        flight = self._start(plan, time.perf_counter())
        if plan.kind != "step":
            return
        outbox: list[Pending | Sent] = list(flight.sends)
        if self.comm is not None and plan.chunks and self.topology.is_sampler:
            outbox.append(self.comm.send_object(flight.results, 0))
        counters = self._finish_step(report=plan.report)
        if counters is not None:
            outbox.append(counters)
        self._outboxes.append(outbox)
        self._drain_outboxes(keep=self.steps_in_flight - 1)

    def _drain_outboxes(self, keep: int) -> None:
        while len(self._outboxes) > keep:
            for item in self._outboxes.popleft():
                item.wait()

    def _start(self, plan: StepPlan, started: float) -> Flight:
        """Run this rank's stage of ``plan`` (the sampler rank also samples)."""
        for request_id in plan.released:
            self.generators.pop(request_id, None)
        if self.comm is not None:
            self.comm.blocking_sends = plan.blocking_sends
        flight = Flight(plan, started)
        if plan.kind != "step" or not plan.chunks:
            return flight
        chunks = plan.chunks
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)
        ordered = [chunks[i] for i in order]
        groups = split_micro_batches(ordered, plan.micro_batches)
        prepared = [self._prepare(group) for group in groups]
        sampled, flight.sends = self._run_stage(prepared, sample=True)
        if sampled is not None:  # this rank sampled: map back to the plan's order
            results: list[SampleResult | None] = [None] * len(chunks)
            for j, result in sampled.items():
                results[order[j]] = result
            flight.results = results
        flight.tokens = sum(len(c.token_ids) for c in chunks)
        flight.prefill_tokens = sum(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)
        return flight

    def _run_stage(
        self, prepared: list[_Prepared], sample: bool
    ) -> tuple[dict[int, SampleResult] | None, list[Pending]]:
        """This rank's stage over the micro-batches. Returns, on the sampling rank, the
        sampled result of each sampling chunk by its index in the concatenated order; and
        the activation sends still on their way to the next stage."""
        topo, comm = self.topology, self.comm
        monitor = comm.monitor if comm is not None else None
        hidden_size = self.arch.hidden_size
        receives: list[Pending] = []
        if comm is not None and topo.prev_rank is not None:
            for i, prep in enumerate(prepared):  # post every receive up front
                buffer = torch.empty(
                    prep.num_tokens, hidden_size, dtype=self.dtype, device=self.device
                )
                receives.append(comm.recv(buffer, topo.prev_rank, tag=i))
        sends: list[Pending] = []
        logits: list[torch.Tensor] = []
        stage_loop = prepared
        if comm is not None and topo.tensor > 1 and topo.pipeline == 1 and len(prepared) > 1:
            # Tensor parallel alone: interleave the micro-batches so each one's all-reduces
            # run behind the next one's compute.
            start = time.perf_counter()
            hiddens = self.model.forward_interleaved(
                [(p.input_ids, p.positions, p.meta) for p in prepared],
                self.rotary,
                self.caches,
                comm.all_reduce_async,
            )
            for prep, hidden in zip(prepared, hiddens, strict=True):
                if sample and prep.samplers:
                    logits.append(self.model.compute_logits(hidden[prep.last_rows]))
            self.backend.synchronize_stream()
            comm.monitor.compute(start, time.perf_counter())
            stage_loop = []
        for i, prep in enumerate(stage_loop):
            inputs = receives[i].wait() if receives else prep.input_ids
            start = time.perf_counter()
            hidden = self.model(inputs, prep.positions, self.rotary, self.caches, prep.meta)
            if topo.is_last_stage and sample and prep.samplers:
                logits.append(self.model.compute_logits(hidden[prep.last_rows]))
            self.backend.synchronize_stream()
            if monitor is not None:
                monitor.compute(start, time.perf_counter())
            if comm is not None and topo.next_rank is not None:
                sends.append(comm.send(hidden, topo.next_rank, tag=i))
        if not (sample and topo.is_sampler):
            return None, sends
        samplers = [
            (offset + j, prep.chunks[j])
            for offset, prep in zip(_offsets(prepared), prepared, strict=True)
            for j in prep.samplers
        ]
        if not samplers:
            return {}, sends
        start = time.perf_counter()
        params = [chunk.params or SamplingParams() for _, chunk in samplers]
        generators = [self._generator(chunk) for _, chunk in samplers]
        drawn = sample_tokens(torch.cat(logits), params, generators)
        if monitor is not None:
            monitor.compute(start, time.perf_counter())
        return {
            index: SampleResult([drawn.token_ids[row]], [drawn.logprobs[row]])
            for row, (index, _) in enumerate(samplers)
        }, sends

    def _finish_step(
        self, wall: float = 0.0, report: bool = False, tokens: int = 0, prefill_tokens: int = 0
    ) -> Sent | None:
        """Fold the step into this rank's counters. On a report step, the other ranks send
        theirs to rank 0 (returned, on its way), which sums them and adapts."""
        if self.comm is None:
            return None
        self.comm.monitor.end_step(wall, tokens, prefill_tokens)
        if not report:
            return None
        totals = self.comm.monitor.totals
        if not self.topology.is_driver:
            return self.comm.send_counters(totals)
        summed = self.comm.recv_counters(totals)
        window = summed.minus(self.replica_counters)
        self.replica_counters = summed
        self.window = window
        if self.config.parallel.micro_batches is None:
            adapt = self.micro_batches
            kept, settled = len(adapt.changes), adapt.settled
            adapt.observe(
                window.overlap,
                window.comm_total > 0,
                window.tokens_per_second,
                window.prefill_share if window.tokens > 0 else None,
            )
            if len(adapt.changes) > kept:
                log.info(
                    "overlap %.2f below %.2f: %d micro-batches from now on",
                    adapt.changes[-1][1],
                    adapt.floor,
                    adapt.micro_batches,
                )
            elif adapt.settled and not settled:
                log.info("more micro-batches cost throughput: staying at %d", adapt.micro_batches)
        return None

    @torch.inference_mode()
    def all_logits(self, seq: Sequence, in_float32: bool = False) -> torch.Tensor:
        """Logits of every token of ``seq`` computed as one prefill ([tokens, vocab]);
        ``in_float32``: the LM head's product in float32 (``CausalLM.compute_logits``)."""
        if self.comm is not None:
            raise RuntimeError("all_logits needs a single-process engine (tensor 1, pipeline 1)")
        prep = self._prepare([_chunk(seq, seq.num_tokens)])
        hidden = self.model(prep.input_ids, prep.positions, self.rotary, self.caches, prep.meta)
        return self.model.compute_logits(hidden, in_float32)

    def _generator(self, chunk: SeqChunk) -> torch.Generator | None:
        params = chunk.params
        if params is None or params.seed is None or params.is_greedy:
            return None
        generator = self.generators.get(chunk.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
            self.generators[chunk.request_id] = generator
        return generator

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]

    def _prepare(self, chunks: list[SeqChunk]) -> _Prepared:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        samplers: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        window = self.arch.sliding_window
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
                prefills.append(self._prefill_span(chunk, row, window))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            prefills=prefills,
        )
        if decode_lens:
            self._decode_metadata(meta, decode_tables, decode_lens, window)
        device = self.device
        return _Prepared(
            chunks,
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(pos, dtype=torch.long, device=device),
            meta,
            torch.tensor(last_rows, dtype=torch.long, device=device),
            samplers,
        )

    def _prefill_span(self, chunk: SeqChunk, row: int, window: int | None) -> PrefillSpan:
        start, end = chunk.start, chunk.end
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
        meta.decode_lens = lengths[:, 0]
        meta.sliding_window = window
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=self.device)
        meta.decode_bias = bias.masked_fill_(~mask, float("-inf"))[:, None, None, :]


def _chunk(seq: Sequence, num_new: int) -> SeqChunk:
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


def _offsets(prepared: list[_Prepared]) -> list[int]:
    out, at = [], 0
    for prep in prepared:
        out.append(at)
        at += len(prep.chunks)
    return out
