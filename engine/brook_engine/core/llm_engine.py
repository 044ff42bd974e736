"""The engine loop: requests in, one scheduled batch per step, tokens and text out.

Used by the offline ``LLM`` API and the HTTP server alike; not thread-safe (one caller drives
``step()``).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import threading
import time
from collections import deque
from pathlib import Path

import torch

from brook_engine.config import ConfigError, EngineConfig
from brook_engine.config.supported import check_supported
from brook_engine.core.engine_stats import engine_stats
from brook_engine.core.model_runner import Flight, ModelRunner
from brook_engine.core.ranks import GroupSpec, LocalWorkers, join_group
from brook_engine.core.requests import Request, RequestError, check_prompt
from brook_engine.core.scheduler import QueueFullError, ScheduledBatch, Scheduler
from brook_engine.core.sequence import FinishReason, Sequence
from brook_engine.device import resolve_backend
from brook_engine.host import process_started
from brook_engine.kv.blocks import BlockManager
from brook_engine.kv.calibration import calibration_text
from brook_engine.kv.prefix import PrefixCache
from brook_engine.layers.sampler import SampleResult, SamplingFailed
from brook_engine.metrics.stats import EngineStats, FinishedRequestStats
from brook_engine.models.arch import ModelArch, resolve_model_folder
from brook_engine.offload.adaptive import AdaptivePolicy
from brook_engine.outputs import RequestOutput
from brook_engine.parallel.comm import Communicator
from brook_engine.sampling_params import SamplingParams
from brook_engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

#: The longest Retry-After a refused request is told (a stalled engine is not waited for).
RETRY_AFTER_MAX_SECONDS = 60


class LLMEngine:
    def __init__(
        self, config: EngineConfig, progress: bool = True, group: GroupSpec | None = None
    ) -> None:
        """Load the model. With ``parallel.tensor × parallel.pipeline > 1`` this process is
        rank 0 of the replica: it starts a worker process for each other device of this
        host (all of them without ``group``; the pod's share of a multi-pod replica with
        it) and waits for every rank to join."""
        self._shutdown_lock = threading.Lock()
        self.config = config
        check_supported(config)
        folder = resolve_model_folder(config.model)
        self.arch = ModelArch.from_folder(folder)
        config.check_against_model(self.arch.facts)
        self.backend = resolve_backend(config.device)
        self.workers: LocalWorkers | None = None
        comm: Communicator | None = None
        if config.parallel.world_size > 1:
            comm = self._start_group(group or GroupSpec.local(config))
        try:
            self._load(config, folder, progress, comm)
        except BaseException:
            self.shutdown()
            raise

    def _start_group(self, spec: GroupSpec) -> Communicator:
        self.comm, self.workers = join_group(self.config, spec, self.backend)
        atexit.register(self.shutdown)
        return self.comm

    comm: Communicator | None = None

    def _load(
        self, config: EngineConfig, folder: Path, progress: bool, comm: Communicator | None
    ) -> None:
        tokenizer_folder = Path(config.model.tokenizer) if config.model.tokenizer else folder
        self.tokenizer = Tokenizer(tokenizer_folder)
        self.served_name = config.model.served_name or folder.name
        dynamic = config.kv_cache.dynamic_precision
        calibration_ids = (
            self.tokenizer.encode(calibration_text(dynamic.calibration_file))
            if config.kv_cache.needs_calibration
            else None
        )
        self.runner = ModelRunner(
            config, folder, self.arch, self.backend, progress, calibration_ids, comm
        )
        self.max_model_len = self.runner.max_model_len
        sharing = config.kv_cache.prefix_sharing
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.kv_cache.block_size,
            PrefixCache(sharing.eviction, sharing.hash) if sharing.enabled else None,
            sharing.min_prefix_len or 0,
        )
        needed = self.block_manager.blocks_needed(self.max_model_len)
        if self.runner.num_blocks < needed:
            raise ConfigError(
                f"kvCache holds {self.runner.num_blocks} blocks but one {self.max_model_len}-"
                f"token sequence needs {needed}; raise kvCache.numBlocks or memoryFraction, or "
                "lower model.maxModelLen"
            )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.adaptive = self._adaptive_offload(config)
        self.eos_token_ids = self._eos_ids(folder)
        self._requests: dict[str, Request] = {}
        # Steps started and not yet collected, oldest first (a pipeline runs several).
        self._in_flight: deque[tuple[ScheduledBatch, Flight]] = deque()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        # Demand turned away by the admission bound: the autoscaler's arrival signal counts it.
        self.num_refused_prompt_tokens_total = 0
        # When recent requests ended (monotonic), for a refused request's Retry-After.
        self._recent_finishes: deque[float] = deque(maxlen=256)
        # Drained by the server after every step; bounded for callers that never drain.
        self._finished_stats: deque[FinishedRequestStats] = deque(maxlen=65536)
        #: Seconds from process start until ready, and until the first generated token.
        self.cold_start = {"ready": time.time() - process_started()}
        graphs = self.runner.graphs
        log.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens, weights loaded in %.1f s%s, "
            "%.1f s after the process started",
            self.served_name,
            self.backend.kind,
            self.runner.dtype,
            self.runner.num_blocks,
            config.kv_cache.block_size,
            self.runner.load_seconds,
            ""
            if graphs is None
            else f", {len(graphs.cache)} shape buckets compiled or loaded in "
            f"{self.runner.compile_seconds:.1f} s",
            self.cold_start["ready"],
        )

    def _adaptive_offload(self, config: EngineConfig) -> AdaptivePolicy | None:
        """``offload.policy: adaptive``: the policy that trades weights for KV blocks (on
        every rank: ``ModelRunner.offload_out``/``offload_back``)."""
        state = self.runner.model.offload
        if config.offload.policy != "adaptive" or state is None:
            return None
        runner, blocks = self.runner, self.block_manager

        def move_out() -> int | None:
            added = runner.offload_out()
            if added:
                blocks.add_blocks(added)
            return added

        def move_back(count: int) -> bool:
            if count and not blocks.top_blocks_idle(count):
                return False
            if count:
                blocks.remove_top_blocks(count)
            runner.offload_back(count)
            return True

        return AdaptivePolicy(
            move_out, move_back, state.describe, lambda n: n == 0 or blocks.top_blocks_idle(n)
        )

    def _eos_ids(self, folder: Path) -> frozenset[int]:
        ids = set(self.arch.eos_token_ids)
        generation = folder / "generation_config.json"
        if generation.exists():
            eos = json.loads(generation.read_text("utf-8")).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        token = self.tokenizer.token_id(self.tokenizer.eos_token)
        if token is not None:
            ids.add(token)
        return frozenset(ids)

    # -- the replica's other ranks ----------------------------------------------------------

    @property
    def is_distributed(self) -> bool:
        return self.comm is not None

    def heartbeat_due(self, interval: float) -> bool:
        """True when no plan has gone to the other ranks for ``interval`` seconds."""
        return time.monotonic() - self.runner.last_plan_time >= interval

    def heartbeat(self) -> None:
        """Idle: check the local workers and tell every rank the replica lives. Raises
        ``ParallelGroupError`` when a rank is gone."""
        self.check_workers()
        self.runner.heartbeat()

    def check_workers(self) -> None:
        if self.workers is not None:
            self.workers.check()

    def shutdown(self) -> None:
        """Stop the other ranks and leave the group (a no-op for a single process)."""
        with self._shutdown_lock:
            comm, self.comm = self.comm, None
            runner = getattr(self, "runner", None)
            if comm is None:
                if runner is not None:
                    runner.stop_streaming()
                return
            if self.workers is not None:
                self.workers.stopping = True
            if runner is not None:
                self._drain_in_flight(runner)
                runner.shutdown()
            else:
                comm.close()
            if self.workers is not None:
                self.workers.stop()
            atexit.unregister(self.shutdown)

    def _drain_in_flight(self, runner: ModelRunner) -> None:
        """Take the tokens of steps still in flight, so every rank ends at the same step
        before it stops (a lost rank makes this fail at once: then there is nothing to
        wait for)."""
        in_flight: deque[tuple[ScheduledBatch, Flight]] = getattr(self, "_in_flight", deque())
        try:
            while in_flight:
                runner.collect(in_flight.popleft()[1])
        except RuntimeError as exc:
            log.debug("steps in flight not collected: %s", exc)

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; ``arrival_time`` (``time.monotonic()``) when it arrived earlier
        than now, e.g. at the HTTP server. Raises ``RequestError`` or ``QueueFullError``."""
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already running")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(ids, self.arch.vocab_size, self.max_model_len)
        seq = Sequence(request_id, ids, len(ids), params)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        try:
            self.scheduler.add(seq)
        except QueueFullError as exc:
            self.num_refused_prompt_tokens_total += len(ids)
            exc.retry_after_seconds = self.queue_drain_seconds()
            raise
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self._requests[request_id] = Request(seq, text, detok)
        self.num_prompt_tokens_total += len(ids)

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request and free every block it holds; False if it is not running."""
        request = self._drop(request_id)
        if request is None:
            return False
        self._record_finished(request.seq)
        return True

    def _drop(self, request_id: str) -> Request | None:
        """Take a request out of the scheduler and free its blocks (None: not running)."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request.seq, FinishReason.ABORT)
            self.runner.release(request_id)
        return request

    def retract_request(self, request_id: str, refused: bool) -> bool:
        """Take back a request just added, before any step ran it: the other choices of a
        call the engine refused. It was never served, so it counts neither as a prompt
        received nor as a request that ended; with ``refused`` (the queue was full) its
        prompt counts as refused demand, as the choice that was refused does."""
        request = self._drop(request_id)
        if request is None:
            return False
        tokens = request.seq.num_prompt_tokens
        self.num_prompt_tokens_total -= tokens
        if refused:
            self.num_refused_prompt_tokens_total += tokens
        return True

    def note_refused(self, num_prompt_tokens: int) -> None:
        """Count prompt tokens of a refused call's choices that were never tried."""
        self.num_refused_prompt_tokens_total += num_prompt_tokens

    def abort_all(self) -> list[str]:
        """Cancel every request; returns their ids."""
        ids = list(self._requests)
        for request_id in ids:
            self.abort_request(request_id)
        return ids

    def warm_up(self) -> float:
        """Run one short request through every stage (prefill, decode, sampling) so the
        first real request does not pay for lazy initialisation; statistics are reset
        after. Returns the seconds it took."""
        started = time.perf_counter()
        num_prompt = max(1, min(8, self.max_model_len - 2))
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        self.add_request("warm-up", [0] * num_prompt, params)
        while self.has_unfinished_requests():
            self.step()
        self._requests.pop("warm-up", None)
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_refused_prompt_tokens_total = 0
        self.scheduler.num_preemptions_total = 0
        self._finished_stats.clear()
        if self.runner.model.expert_load is not None:
            self.runner.model.expert_load.reset()
        return time.perf_counter() - started

    # -- statistics ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """Gauges and running totals as of now (cheap; called after every step)."""
        return engine_stats(
            self.scheduler,
            self.block_manager,
            self.runner,
            self.num_prompt_tokens_total,
            self.num_generation_tokens_total,
            self.cold_start,
            self.num_refused_prompt_tokens_total,
        )

    def estimate_memory(self, seq_len: int, batch: int) -> dict[str, int]:
        """Bytes ``batch`` sequences of ``seq_len`` tokens take on the device under this
        engine's KV policy (as calibrated): weights, their KV blocks, and the total."""
        blocks = batch * self.block_manager.blocks_needed(seq_len)
        kv = blocks * self.block_manager.block_size * self.runner.kv_bytes_per_token
        weights = self.runner.weight_bytes
        return {"weights": weights, "kv_cache": kv, "total": weights + kv}

    def sequences_fitting(self, seq_len: int, kv_budget_bytes: int) -> int:
        """How many ``seq_len``-token sequences a KV budget of this many bytes holds."""
        per_sequence = self.estimate_memory(seq_len, 1)["kv_cache"]
        return kv_budget_bytes // per_sequence

    def take_finished_stats(self) -> list[FinishedRequestStats]:
        """Requests that ended since the last call, finished or aborted."""
        taken = list(self._finished_stats)
        self._finished_stats.clear()
        return taken

    def queue_drain_seconds(self) -> int:
        """Seconds until the requests waiting now have entered the running batch, at the
        rate requests ended over the last minute (each end frees the slot one of them
        takes); 1 to ``RETRY_AFTER_MAX_SECONDS``, and 1 without a minute's data."""
        now = time.monotonic()
        recent = [t for t in self._recent_finishes if now - t <= 60.0]
        if len(recent) < 2 or recent[-1] <= recent[0]:
            return 1
        rate = (len(recent) - 1) / (now - recent[0])
        waiting = self.scheduler.num_waiting
        return max(1, min(RETRY_AFTER_MAX_SECONDS, math.ceil(waiting / rate)))

    def _record_finished(self, seq: Sequence) -> None:
        self._recent_finishes.append(time.monotonic())
        self._finished_stats.append(
            FinishedRequestStats(
                finish_reason=seq.finish_reason.value if seq.finish_reason else "abort",
                num_prompt_tokens=seq.num_prompt_tokens,
                num_generation_tokens=seq.num_output_tokens,
                arrival_time=seq.arrival_time,
                scheduled_time=seq.scheduled_time,
                first_token_time=seq.first_token_time,
                finished_time=time.monotonic(),
            )
        )

    def prompt_logits(self, token_ids: list[int], in_float32: bool = False) -> torch.Tensor:
        """Float32 logits [tokens, vocab] of every position of ``token_ids``, computed through
        the paged cache as a prefill (for tests and measurements; needs free blocks).
        ``in_float32``: the LM head's product in float32 too, not only its result."""
        seq = Sequence("logits-probe", list(token_ids), len(token_ids), SamplingParams())
        self.block_manager.grow(seq.block_table, len(token_ids))
        try:
            return self.runner.all_logits(seq, in_float32)
        finally:
            self.block_manager.release(seq.block_table)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advance the engine by one step; returns an output for every request that gained
        text or ended. One device: schedule a batch, run it, apply its tokens. A pipeline
        keeps up to ``steps_in_flight`` steps going: it starts the next one and applies the
        oldest, so its first stage computes while the later stages finish the step before."""
        depth = self.runner.steps_in_flight
        issued = False
        changing = self.adaptive is not None and self.adaptive.wants_change
        if len(self._in_flight) < depth and not changing:  # a change waits for an empty pipe
            batch = self.scheduler.schedule(depth)
            if batch.seqs:
                flight = self.runner.issue(batch)
                for seq in batch.seqs:
                    seq.in_flight = True
                self._in_flight.append((batch, flight))
                issued = True
        if not self._in_flight or (issued and len(self._in_flight) < depth):
            return []
        batch, flight = self._in_flight.popleft()
        try:
            results = self.runner.collect(flight)
        finally:
            for seq in batch.seqs:
                seq.in_flight = False
        outputs = self._apply(batch, results)
        if self.adaptive is not None:
            self.adaptive.after_step(
                batch.kv_blocked or batch.num_preempted > 0, self.scheduler.num_waiting
            )
            if self.adaptive.wants_change and not self._in_flight:
                self.adaptive.act()  # between steps, on every rank
        return outputs

    def _apply(
        self, batch: ScheduledBatch, results: list[SampleResult | None]
    ) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for seq, num_new, result in zip(batch.seqs, batch.num_new_tokens, results, strict=True):
            if seq.is_finished:  # aborted while its step was in flight
                continue
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq)
            if result is None:
                continue
            request = self._requests[seq.request_id]
            try:
                error = result.error(0)
                if error is not None:
                    raise SamplingFailed(error)
                self._add_token(request, result, now)
                outputs.append(self._output(request, now))
            except Exception as exc:  # this request fails alone; the batch goes on
                log.warning("request %s failed: %s", seq.request_id, exc)
                outputs.append(self._fail(request, str(exc), now))
        return outputs

    def _add_token(self, request: Request, result: SampleResult, now: float) -> None:
        seq = request.seq
        token = result.token_ids[0]
        seq.token_ids.append(token)
        self.num_generation_tokens_total += 1
        if "first_token" not in self.cold_start:
            self.cold_start["first_token"] = time.time() - process_started()
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.params.logprobs is not None and result.logprobs[0] is not None:
            seq.logprobs.append(result.logprobs[0])
        request.detokenizer.add(token)
        self._check_stop(request, token)

    def _fail(self, request: Request, error: str, now: float) -> RequestOutput:
        """End ``request`` with ``error`` (finish reason "error"), its blocks freed."""
        seq = request.seq
        self._requests.pop(seq.request_id, None)
        if not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.ERROR)
            self.runner.release(seq.request_id)
            self._record_finished(seq)
        return request.failed_output(error, now)

    def _check_stop(self, request: Request, token: int) -> None:
        reason = request.finish_reason(token, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.scheduler.finish(request.seq, reason)
            self.runner.release(request.seq.request_id)
            self._record_finished(request.seq)

    def _output(self, request: Request, now: float) -> RequestOutput:
        if request.seq.is_finished:
            del self._requests[request.seq.request_id]
        return request.output(now)
