"""Loads this rank's part of the model and its KV cache onto the device and runs one
scheduled batch per step: the batch's chunks as tensors (``step_inputs``), the decoder, the
sampler.

The same runner runs on every rank of a tensor- or pipeline-parallel replica. Rank 0 turns
the scheduled batch into a step plan and sends it to the others; every rank then runs its
stage over the plan's micro-batches (receiving activations from the stage before, sending
them on asynchronously while it computes the next micro-batch), and the last stage samples
and sends the tokens back to rank 0. A single-process engine is the same code with one rank
and no communication."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from brook_engine.compile.graphs import CompiledLayers
from brook_engine.compile.layer_graph import LayerSpec
from brook_engine.config import EngineConfig, KVDType
from brook_engine.core.replica import ReplicaFacts, gather_replica_facts, rank_shard
from brook_engine.core.sampling import ChunkSampler
from brook_engine.core.scheduler import ScheduledBatch
from brook_engine.core.sequence import Sequence
from brook_engine.core.step_inputs import StepInputBuilder, StepInputs, chunk_of, offsets
from brook_engine.device import Backend
from brook_engine.kv import sizing
from brook_engine.kv.cache import LayerKVCache
from brook_engine.kv.calibration_store import (
    CalibrationStore,
    store_facts,
    weights_fingerprint,
)
from brook_engine.kv.setup import CalibrationPass, set_up_kv_cache
from brook_engine.kv.sizing import KVLayout
from brook_engine.layers.rotary import RotaryEmbedding
from brook_engine.layers.sampler import SampleResult
from brook_engine.models.arch import ModelArch
from brook_engine.models.loader import add_one_row_copies, load_model
from brook_engine.offload.adaptive import RankMover
from brook_engine.offload.plan import with_checkpoint_quantization
from brook_engine.offload.setup import rank_plan
from brook_engine.offload.streamer import WeightStreamer
from brook_engine.parallel.comm import Communicator, Pending, Sent
from brook_engine.parallel.overlap import Counters, micro_batch_adaptation
from brook_engine.parallel.plan import SeqChunk, StepPlan, split_micro_batches
from brook_engine.parallel.topology import Topology

log = logging.getLogger(__name__)


#: Overlap counters are summed at rank 0 every this many steps (one small collective).
REPORT_EVERY_STEPS = 8


@dataclass
class Flight:
    """A step on its way through the replica: what rank 0 keeps until ``collect``."""

    plan: StepPlan
    started: float
    sends: list[Pending] = field(default_factory=list)
    results: list[SampleResult | None] | None = None  # set where this rank sampled
    tokens: int = 0
    prefill_tokens: int = 0


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
        self.topology = topo = comm.topology if comm is not None else Topology.single()
        dtype_name = config.model.dtype
        self.dtype = backend.model_dtype(dtype_name)
        self.max_model_len = config.model.max_model_len or arch.max_position_embeddings
        self.block_size = config.kv_cache.block_size

        self.shard = rank_shard(config, arch, topo)
        self.layer_start, self.layer_end = self.shard.layer_start, self.shard.layer_end
        started = time.perf_counter()
        self.offload_plan = rank_plan(
            with_checkpoint_quantization(config, arch.extra),
            arch.shape,
            self.device,
            self.dtype,
            topo.rank,
            topo.stage,
            topo.tp_rank,
            (self.shard.layer_start, self.shard.layer_end or arch.num_layers),
            self.shard.first_stage,
            self.shard.last_stage,
        )
        self.model, self.weight_bytes = load_model(
            arch,
            folder,
            self.dtype,
            self.device,
            self.shard,
            comm,
            progress and topo.is_driver,
            config.quantization.weights,
            config.quantization.group_size,
            self.offload_plan,
            config,
        )
        copies = add_one_row_copies(
            self.model, config.shapes.one_row_weights, self.dtype, self.device
        )
        self.one_row_copies = copies is not None
        self.weight_bytes += copies or 0
        self.load_seconds = time.perf_counter() - started
        kv_start, kv_end = self.shard.kv_heads(arch.num_heads, arch.num_kv_heads)
        self.rotary = RotaryEmbedding(
            arch.head_dim,
            self.max_model_len,
            arch.rope_theta,
            arch.rope_type,
            arch.rope_scaling,
            self.dtype,
            self.device,
        )
        self.inputs = StepInputBuilder(self.block_size, arch.sliding_window, self.device)
        policy = config.kv_cache.layer_dtypes(arch.num_layers)
        self.kv_layout = KVLayout(
            policy[self.layer_start : self.layer_end],
            kv_end - kv_start,  # this rank's KV heads
            arch.head_dim,
            self.block_size,
            self.dtype,
        )
        # Steps in flight at once: a pipeline's first stage starts the next step while the
        # later stages finish this one (each step holds its own sequences).
        self.steps_in_flight = (
            (config.parallel.steps_in_flight or topo.pipeline) if topo.pipeline > 1 else 1
        )
        self.micro_batches = micro_batch_adaptation(
            topo.tensor, topo.pipeline, self.steps_in_flight, config.parallel.micro_batches
        )
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
        kv = set_up_kv_cache(
            config,
            policy,
            self.kv_layout,
            self.max_model_len,
            backend.kv_cache_budget,
            self.device,
            calibration_ids,
            CalibrationPass(
                self._calibration_prefill,
                [layer.self_attn for layer in self.model.model.layers],
                lambda at: self.rotary.lookup(at.to(self.device)),
                self.model.streamer.holding
                if isinstance(self.model.streamer, WeightStreamer)
                else None,
            ),
            comm,
            self._calibration_store(folder),
        )
        self.kv_layout, self.calibration = kv.layout, kv.calibration
        self.num_blocks, self.caches = kv.num_blocks, kv.caches
        state = self.model.offload
        #: ``offload.policy: adaptive``: this rank's side of the moves rank 0 decides.
        self.mover = (
            RankMover(state, list(config.offload.priority_layers))
            if config.offload.policy == "adaptive" and state is not None
            else None
        )
        if isinstance(self.model.streamer, WeightStreamer):
            self.model.streamer.reset_stats()  # count serving's transfers, not start-up's
        self.sampler = ChunkSampler(self.device)
        self.compile_seconds = 0.0
        #: Compile mode: the stage's layer graphs (also the model's, which runs them).
        self.graphs: CompiledLayers | None = None
        if config.shapes.mode == "compile" and len(self.model.model.layers):
            started = time.perf_counter()
            self.graphs = CompiledLayers(
                LayerSpec.of_arch(arch, topo.tensor, self.dtype, self.device),
                config.shapes,
                config.scheduler.max_num_batched_tokens,
                config.scheduler.max_num_seqs,
            )
            self.graphs.compile_registered(progress and topo.is_driver)
            self.model.graphs = self.graphs
            self.compile_seconds = time.perf_counter() - started
        self.replica = gather_replica_facts(
            ReplicaFacts(
                list(self.layer_kinds),
                list(self.calibration.errors) if self.calibration else None,
                self.kv_layout.bytes_per_token,
                self.weight_bytes,
            ),
            comm,
        )

    @property
    def layer_kinds(self) -> list[KVDType]:
        """This rank's layers' KV storage dtypes (as calibrated)."""
        return self.kv_layout.layer_kinds

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes in the whole replica (every rank's layers and heads)."""
        return self.replica.kv_bytes_per_token

    # -- the KV cache ----------------------------------------------------------------------

    @torch.inference_mode()
    def _calibration_store(self, folder: Path) -> Callable[[list[int]], CalibrationStore] | None:
        """Where this rank keeps its KV calibration: ``shapes.cacheDir``, keyed on what the
        outcome depends on (``kv.calibration_store``); None without a cache folder."""
        config = self.config
        if config.shapes.cache_dir is None or not config.kv_cache.needs_calibration:
            return None
        topo = self.topology
        facts = store_facts(
            weights=weights_fingerprint(folder),
            quantization=config.quantization.model_dump(mode="json"),
            dynamic=config.kv_cache.dynamic_precision.model_dump(mode="json"),
            policy=list(self.kv_layout.layer_kinds),
            layers=[self.layer_start, self.layer_end],
            tensor=[topo.tp_rank, topo.tensor],
            max_model_len=self.max_model_len,
            dtype=str(self.dtype),
            device=self.device.type,
        )
        cache_dir = config.shapes.cache_dir

        def store(ids: list[int]) -> CalibrationStore:
            tokens = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
            return CalibrationStore.at(cache_dir, {**facts, "tokens": tokens})

        return store

    def _calibration_prefill(self, caches: list[LayerKVCache], ids: list[int]) -> None:
        """Run ``ids`` from position 0 through this rank's stage over ``caches``."""
        blocks = list(range(-(-len(ids) // self.block_size)))
        chunk = SeqChunk("kv-calibration", ids, 0, blocks, False, None)
        self.caches = caches
        try:
            _, sends = self._run_stage([self.inputs.build([chunk])], sample=False)
            for pending in sends:
                pending.wait()
        finally:
            self.caches = []
        self._finish_step()

    def resize_kv(self, num_blocks: int) -> None:
        """Grow or shrink every layer's cache to ``num_blocks`` blocks (between steps)."""
        for cache in self.caches:
            cache.resize(num_blocks)
        self.num_blocks = num_blocks
        self.model.row_decoding.forget()  # its per-layer plans point at the old tensors

    # -- the adaptive offload's moves (rank 0 decides, between steps, nothing in flight) ---

    def offload_out(self) -> int | None:
        """Rank 0: every rank streams its next pieces and the KV cache grows by the fewest
        blocks any rank freed (the block table is shared). The blocks added, or None when
        that is none (some rank had nothing left to move): the move is then undone on every
        rank, since weights that stream for no KV blocks only slow the steps."""
        if self.comm is not None:
            self.comm.send_plan(StepPlan("offload_out"), keep=self.steps_in_flight)
            self.last_plan_time = time.monotonic()
        return self._offload_out()

    def offload_back(self, blocks: int) -> None:
        """Rank 0 (the cache's last ``blocks`` blocks idle): every rank gives them back and
        makes the pieces of its last move out resident again."""
        if self.comm is not None:
            self.comm.send_plan(StepPlan("offload_back", blocks=blocks), keep=self.steps_in_flight)
            self.last_plan_time = time.monotonic()
        self._offload_back(blocks)

    def _offload_out(self) -> int | None:
        assert self.mover is not None, "offload_out without the adaptive policy"
        freed = self.mover.move_out()
        blocks = freed // (self.kv_layout.bytes_per_token * self.block_size)
        if self.comm is not None:
            self._drain_outboxes(keep=0)
            blocks = self.comm.min_int(blocks)
        if not blocks:
            self.mover.move_back()  # on every rank: the cache could not grow
            return None
        self.resize_kv(self.num_blocks + blocks)
        return blocks

    def _offload_back(self, blocks: int) -> None:
        assert self.mover is not None, "offload_back without the adaptive policy"
        if blocks:
            self.resize_kv(self.num_blocks - blocks)  # the cache first: the weights' room
        self.mover.move_back()

    def kv_bytes_by_dtype(self, num_blocks: int) -> dict[str, int]:
        """Bytes ``num_blocks`` blocks take in this rank's layers of each storage dtype."""
        return self.kv_layout.bytes_by_dtype(num_blocks)

    def memory_bytes(self) -> dict[str, int]:
        """Device memory of this rank by kind: weights, KV cache, and activations (the
        allocator's peak beyond the two on accelerators; on CPU, which has no allocator
        statistics, an estimate of the largest step the scheduler allows)."""
        kv = sizing.cache_bytes(self.caches)
        peak = self.backend.peak_allocated()
        if peak is not None:
            activations = max(0, peak - self.weight_bytes - kv)
        else:
            scheduler = self.config.scheduler
            activations = self.arch.activation_bytes(
                scheduler.max_num_batched_tokens,
                scheduler.max_num_seqs,
                self.topology.tensor,
                self.dtype.itemsize,
            )
        state = self.model.offload
        weights = state.ledger.held if state is not None else self.weight_bytes
        return {"weights": weights, "kv_cache": kv, "activations": activations}

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)
        if self.comm is not None and not self.topology.is_sampler:
            self._released.append(request_id)

    # -- the step (rank 0) -----------------------------------------------------------------

    @torch.inference_mode()
    def issue(self, batch: ScheduledBatch) -> Flight:
        """Start a step: send its plan to the other ranks and run this rank's stage. In a
        pipeline it returns while the later stages still work on it (``collect`` takes its
        tokens), so the next step's first stage can run meanwhile."""
        chunks = [chunk_of(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
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
        """Rank 0: let the other ranks exit; every rank: leave the group (and stop streaming
        weights)."""
        self.stop_streaming()
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

    def stop_streaming(self) -> None:
        """Stop weight offload's copy thread and close its spill file, and online learning's
        compile thread (idempotent)."""
        state = self.model.offload
        if state is not None:
            state.close()
        if self.graphs is not None:
            self.graphs.close()

    # -- the step (every rank) -------------------------------------------------------------

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> None:
        """A rank other than 0: run this rank's part of a step. The last stage's sampler
        sends the tokens to rank 0, and on a report step every rank its counters.

        Nothing here waits for the step's own sends: rank 0 takes step k's tokens and
        counters only after it issued step k + stepsInFlight - 1, which needs this rank
        (a tensor-parallel peer's all-reduce, a stage's activations). So a rank waits for a
        step's sends only once it has run that later step too."""
        if plan.kind == "offload_out":
            self._offload_out()
            return
        if plan.kind == "offload_back":
            self._offload_back(plan.blocks)
            return
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
            self.sampler.release(request_id)
        if self.comm is not None:
            self.comm.blocking_sends = plan.blocking_sends
        flight = Flight(plan, started)
        if plan.kind != "step" or not plan.chunks:
            return flight
        chunks = plan.chunks
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)
        ordered = [chunks[i] for i in order]
        groups = split_micro_batches(ordered, plan.micro_batches)
        prepared = [self.inputs.build(group) for group in groups]
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
        self, prepared: list[StepInputs], sample: bool
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
        if (
            comm is not None
            and topo.tensor > 1
            and topo.pipeline == 1
            and len(prepared) > 1
            and self.graphs is None  # compiled layers reduce inside their graph
        ):
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
            for offset, prep in zip(offsets(prepared), prepared, strict=True)
            for j in prep.samplers
        ]
        if not samplers:
            return {}, sends
        start = time.perf_counter()
        drawn = self.sampler.sample(torch.cat(logits), [chunk for _, chunk in samplers])
        if monitor is not None:
            monitor.compute(start, time.perf_counter())
        return {index: result for (index, _), result in zip(samplers, drawn, strict=True)}, sends

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
            self.micro_batches.observe_window(window)
        return None

    @torch.inference_mode()
    def all_logits(self, seq: Sequence, in_float32: bool = False) -> torch.Tensor:
        """Logits of every token of ``seq`` computed as one prefill ([tokens, vocab]);
        ``in_float32``: the LM head's product in float32 (``CausalLM.compute_logits``)."""
        if self.comm is not None:
            raise RuntimeError("all_logits needs a single-process engine (tensor 1, pipeline 1)")
        prep = self.inputs.build([chunk_of(seq, seq.num_tokens)])
        hidden = self.model(prep.input_ids, prep.positions, self.rotary, self.caches, prep.meta)
        return self.model.compute_logits(hidden, in_float32)
