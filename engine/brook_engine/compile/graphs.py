"""Compile mode for one rank: the stage's decoder layers run as compiled graphs of the step's
token bucket, eager where no graph is held.

- **Registered buckets** (those ``shapes.patterns`` imply; every bucket up to the token budget
  without patterns) are compiled before the engine reports ready, up to
  ``shapes.kernelCacheSize``.
- **Online learning** (``shapes.onlineLearning``): a bucket that missed ``ONLINE_AFTER`` steps
  is compiled on a background thread while steps go on in eager, and swapped in between
  steps.
- **Failures**: a bucket whose compilation fails, or whose graph fails at run time, runs
  eager from then on; logged once, counted, and the step is rerun eagerly (rewriting the
  same KV slots with the same values).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from brook_engine.compile import ops
from brook_engine.compile.buckets import bucket_for, pattern_buckets, token_buckets
from brook_engine.compile.graph_cache import CompileStats, GraphCache
from brook_engine.compile.layer_graph import LayerGraph, LayerSpec, compile_layer, pad_rows
from brook_engine.compile.persistent import use_cache_dir
from brook_engine.config.runtime import ShapesConfig
from brook_engine.kv.cache import LayerKVCache
from brook_engine.layers.attention import AttentionMetadata
from brook_engine.models.decode_row import RowStep

if TYPE_CHECKING:
    from brook_engine.models.llama import CausalLM

log = logging.getLogger(__name__)

#: Steps an uncompiled bucket runs eager before online learning compiles it.
ONLINE_AFTER = 8


class CompiledLayers:
    def __init__(
        self,
        spec: LayerSpec,
        shapes: ShapesConfig,
        max_tokens: int,
        max_seqs: int,
        compiler: Any = None,
    ) -> None:
        """``compiler(spec, tokens, folder)``: ``compile_layer`` unless given."""
        self.spec = spec
        self.buckets = token_buckets(max_tokens)
        patterns = [(p.input_len, p.output_len) for p in shapes.patterns]
        self.registered = pattern_buckets(patterns, max_tokens, max_seqs) or list(self.buckets)
        self.online = shapes.online_learning
        self.cache = GraphCache(shapes.kernel_cache_size)
        self.cache_dir = use_cache_dir(shapes.cache_dir, spec.facts())
        self._compiler = compiler
        self._seen: Counter[int] = Counter()
        self._failed: set[int] = set()
        self._pending: dict[int, Future[LayerGraph | None]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # compile counters, written by the background thread
        self.compiles = 0
        self.compile_seconds = 0.0

    # -- compiling ---------------------------------------------------------------------------

    def compile_registered(self, progress: bool = False) -> None:
        """Compile the registered buckets now (before ready), up to the cache's capacity."""
        wanted = self.registered[: self.cache.capacity]
        if len(wanted) < len(self.registered):
            log.warning(
                "shapes: %d registered buckets, kernelCacheSize holds %d: compiling %s; raise "
                "kernelCacheSize to hold them all",
                len(self.registered),
                self.cache.capacity,
                wanted,
            )
        started = time.perf_counter()
        for i, bucket in enumerate(wanted):
            graph = self._compile(bucket)
            if graph is not None:
                self.cache.put(bucket, graph)
            if progress:
                log.info("compiled bucket %d tokens (%d of %d)", bucket, i + 1, len(wanted))
        log.info(
            "compiled %d of %d token buckets in %.1f s (cache %s)",
            len(self.cache),
            len(wanted),
            time.perf_counter() - started,
            self.cache_dir,
        )

    def _compile(self, bucket: int) -> LayerGraph | None:
        started = time.perf_counter()
        try:
            compiler = self._compiler or compile_layer
            graph: LayerGraph | None = compiler(self.spec, bucket, self.cache_dir)
        except Exception as exc:
            graph = None
            log.warning(
                "compiling the %d-token bucket failed; it runs eager: %s: %s",
                bucket,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
        with self._lock:
            self.compile_seconds += time.perf_counter() - started
            self.compiles += 1
            if graph is None:
                self._failed.add(bucket)
        return graph

    def _learn(self, bucket: int) -> None:
        """Count a miss of ``bucket``; start its compilation once it is hot."""
        if not self.online or bucket in self._failed or bucket in self._pending:
            return
        self._seen[bucket] += 1
        if self._seen[bucket] < ONLINE_AFTER:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="brook-compile")
        self._pending[bucket] = self._executor.submit(self._compile, bucket)

    def swap_in(self) -> None:
        """Hold the graphs online learning finished (between steps)."""
        for bucket, future in list(self._pending.items()):
            if future.done():
                del self._pending[bucket]
                graph = future.result()
                if graph is not None:
                    self.cache.put(bucket, graph)
                    log.info("online learning: the %d-token bucket is compiled", bucket)

    def wait_for_pending(self, timeout: float | None = None) -> None:
        """Wait for online learning's compilations in flight, then swap them in."""
        for future in list(self._pending.values()):
            future.result(timeout)
        self.swap_in()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def stats(self) -> CompileStats:
        with self._lock:
            return CompileStats(
                graphs=len(self.cache),
                hits=self.cache.hits,
                misses=self.cache.misses,
                evictions=self.cache.evictions,
                compiles=self.compiles,
                failures=len(self._failed),  # a failed bucket is never compiled again
                compile_seconds=self.compile_seconds,
            )

    # -- running -----------------------------------------------------------------------------

    def graph_for(self, tokens: int) -> tuple[int, LayerGraph] | None:
        """The bucket and graph a step of ``tokens`` tokens runs; None: it runs eager."""
        self.swap_in()
        bucket = bucket_for(tokens, self.buckets)
        if bucket is None:
            self.cache.misses += 1
            return None
        graph = self.cache.get(bucket)
        if graph is None:
            self._learn(bucket)
            return None
        return bucket, graph

    def run(
        self,
        model: CausalLM,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        caches: list[LayerKVCache],
        meta: AttentionMetadata,
        row: RowStep | None = None,
    ) -> torch.Tensor | None:
        """``model``'s stage over the step's hidden states ``x`` [tokens, hidden] (embedded
        on the first stage) through the bucket's graph, the same result as
        ``CausalLM.forward``'s eager layers; None where the step runs eager. ``row``: a
        single decoding sequence's step, whose layers Brook's decoder-layer kernel covers
        run that kernel (one call each) and the others the graph."""
        tokens = int(x.shape[0])
        found = self.graph_for(tokens)
        if found is None:
            return None
        bucket, graph = found
        try:
            return self._run(graph, bucket, model, x, cos_sin, caches, meta, row)
        except Exception as exc:
            self.cache.drop(bucket)
            self.cache.hits -= 1
            self.cache.misses += 1
            with self._lock:
                self._failed.add(bucket)
            log.warning(
                "the compiled %d-token graph failed; the bucket runs eager from now on: %s: %s",
                bucket,
                type(exc).__name__,
                exc,
            )
            return None

    def _run(
        self,
        graph: LayerGraph,
        bucket: int,
        model: CausalLM,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        caches: list[LayerKVCache],
        meta: AttentionMetadata,
        row: RowStep | None,
    ) -> torch.Tensor:
        tokens = int(x.shape[0])
        x = pad_rows(x, bucket)
        cos, sin = (pad_rows(t, bucket) for t in cos_sin)
        delta = torch.zeros_like(x)
        layers: list[Any] = list(model.model.layers)
        with ops.running(ops.StepContext(layers, caches, meta, tokens)) as context:

            def run_layer(
                i: int, layer: Any, _: LayerKVCache, x: torch.Tensor, delta: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
                context.layer = i
                norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
                out: tuple[torch.Tensor, torch.Tensor] = graph(x, delta, cos, sin, *norms)
                return out

            x, last = model.run_layers(x, delta, caches, row, run_layer)
        assert last is not None
        return model.stage_output(x[:tokens], last[:tokens])
