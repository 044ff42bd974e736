"""``brook-engine compile``: fill ``shapes.cacheDir`` ahead of time, so replicas that start
on it load their graphs instead of compiling them (a Job or an init step can run it).

It needs the configuration (an engine file or an ``LLMInference`` manifest) and the model's
``config.json``, not its weights: the graphs hold none. It compiles what an engine of that
configuration compiles before it is ready — the registered buckets, up to
``kernelCacheSize`` — for one rank's share of the layers (every rank's is alike), on this
machine's device, so run it where the replicas run (the same CPU flags, or the same
accelerator and software)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from brook_engine.config import ConfigError, EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileReport:
    folder: Path
    buckets: list[int]
    compiled: list[int]
    seconds: float

    def text(self) -> str:
        return (
            f"compiled {len(self.compiled)} of {len(self.buckets)} token buckets "
            f"{self.compiled} in {self.seconds:.1f} s into {self.folder}"
        )


def compile_ahead(config: EngineConfig, model_config: Path | None) -> CompileReport:
    """Compile ``config``'s registered buckets into its ``shapes.cacheDir``."""
    shapes = config.shapes
    if shapes.mode != "compile":
        raise ConfigError("shapes.mode: eager compiles nothing; set shapes.mode: compile")
    if shapes.cache_dir is None:
        raise ConfigError(
            "shapes.cacheDir: set the folder the replicas read, or nothing outlives this run"
        )
    from brook_engine.compile.graphs import CompiledLayers
    from brook_engine.compile.layer_graph import LayerSpec
    from brook_engine.device import resolve_backend
    from brook_engine.models.arch import ModelArch
    from brook_engine.offload.command import read_model_config

    arch = ModelArch.from_dict(read_model_config(config, model_config))
    config.check_against_model(arch.shape.facts)
    backend = resolve_backend(config.device)
    dtype = backend.model_dtype(config.model.dtype)
    spec = LayerSpec.of_arch(arch, config.parallel.tensor, dtype, backend.device)
    scheduler = config.scheduler
    layers = CompiledLayers(spec, shapes, scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
    started = time.perf_counter()
    layers.compile_registered(progress=True)
    layers.close()
    return CompileReport(
        layers.cache_dir,
        layers.registered[: layers.cache.capacity],
        sorted(layers.cache.buckets),
        time.perf_counter() - started,
    )
