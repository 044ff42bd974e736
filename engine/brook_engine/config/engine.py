"""``EngineConfig``: the engine's whole configuration, and the file it is read from.

The same model is the ``LLMInference`` resource's engine sections (the operator writes it
into the pod as a mounted file) and the keyword arguments of the offline ``LLM`` API.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from brook_engine.config.base import ConfigError, Section
from brook_engine.config.errors import describe_errors
from brook_engine.config.model import ModelConfig
from brook_engine.config.sections import EngineSections
from brook_engine.config.server import ServerConfig

DeviceKind = Literal["auto", "cpu", "cuda", "npu"]


@dataclass(frozen=True)
class ModelFacts:
    """What a model's config.json says that the configuration must fit."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    num_experts: int = 0
    experts_per_token: int = 0
    intermediate_size: int = 0
    architecture: str = ""
    qk_norm: bool = False  # Qwen3's per-head q/k RMSNorm
    shared_expert_size: int = 0  # Qwen2-MoE's shared expert width


class _ModelAndDevice(Section):
    """``EngineConfig``'s first fields: a base listed after ``EngineSections`` only so that
    they come before the sections (pydantic lists inherited fields first)."""

    model: ModelConfig
    """The model to serve."""

    device: DeviceKind = "auto"
    """Backend: npu (torch-npu, HCCL), cuda (NCCL), cpu (gloo); auto picks the first present
    in that order."""


class EngineConfig(EngineSections, _ModelAndDevice):
    """Everything the engine needs to serve one model replica."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    """The HTTP server."""

    @model_validator(mode="after")
    def _sections_agree(self) -> EngineConfig:
        problems = _cross_section_problems(self, self.model.max_model_len)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def check_against_model(self, facts: ModelFacts) -> None:
        """Checks that need the model's shape; raises ``ConfigError`` listing every problem."""
        problems: list[str] = []
        par = self.parallel
        if par.pipeline > facts.num_layers:
            problems.append(
                f"parallel.pipeline ({par.pipeline}) exceeds the model's {facts.num_layers} "
                f"layers; use at most {facts.num_layers}"
            )
        if par.stage_layers is not None and sum(par.stage_layers) != facts.num_layers:
            problems.append(
                f"parallel.stageLayers sums to {sum(par.stage_layers)} layers but the model has "
                f"{facts.num_layers}; make the counts add up to {facts.num_layers}"
            )
        if facts.num_attention_heads % par.tensor:
            problems.append(
                f"parallel.tensor ({par.tensor}) must divide the model's "
                f"{facts.num_attention_heads} attention heads"
            )
        if facts.intermediate_size % par.tensor:
            problems.append(
                f"parallel.tensor ({par.tensor}) must divide the model's MLP width "
                f"({facts.intermediate_size})"
            )
        kv = facts.num_kv_heads
        if kv % par.tensor and par.tensor % kv:
            problems.append(
                f"parallel.tensor ({par.tensor}) and the model's {kv} KV heads must divide "
                "one another"
            )
        max_len = self.model.max_model_len
        if max_len is not None and max_len > facts.max_position_embeddings:
            problems.append(
                f"model.maxModelLen ({max_len}) exceeds the model's maxPositionEmbeddings "
                f"({facts.max_position_embeddings}); lower it"
            )
        problems += _model_kind_problems(self, facts)
        effective_len = max_len if max_len is not None else facts.max_position_embeddings
        problems += _cross_section_problems(self, effective_len)
        if problems:
            raise ConfigError("; ".join(dict.fromkeys(problems)))


def _model_kind_problems(config: EngineConfig, facts: ModelFacts) -> list[str]:
    """Settings that depend on the model being mixture-of-experts (or using Qwen3's q/k
    norms): refused where this build does not run them, never ignored. (What needs no model
    facts is refused in ``supported``, with its CEL twin.)"""
    problems: list[str] = []
    moe, par, name = config.moe, config.parallel, facts.architecture or "this model"
    if not facts.num_experts:
        defaults = type(moe)()
        for field, key in (
            ("top_k", "topK"),
            ("load_threshold", "loadThreshold"),
            ("reroute", "reroute"),
        ):
            if getattr(moe, field) != getattr(defaults, field):
                problems.append(
                    f"moe.{key}: {name} is a dense model (no experts); remove moe.{key}"
                )
        experts = ""
    else:
        if moe.top_k is not None and moe.top_k > facts.num_experts:
            problems.append(
                f"moe.topK ({moe.top_k}) exceeds the model's {facts.num_experts} experts"
            )
        top_k = moe.top_k or facts.experts_per_token
        if moe.reroute and top_k == 1:
            problems.append(
                "moe.reroute: with one expert per token there is no other choice to send a "
                "token to; remove moe.reroute or raise moe.topK"
            )
        if facts.num_experts % par.tensor:
            problems.append(
                f"parallel.tensor ({par.tensor}) must divide the model's {facts.num_experts} "
                "experts (expert parallelism gives each tensor rank an equal share)"
            )
        if facts.shared_expert_size % par.tensor:
            problems.append(
                f"parallel.tensor ({par.tensor}) must divide the model's shared-expert width "
                f"({facts.shared_expert_size})"
            )
        if config.offload.policy != "none":
            problems.append(
                f"offload.policy: weight offload streams dense layers so far; {name} is a "
                "mixture-of-experts model — use none"
            )
        experts = "mixture-of-experts "
    if config.shapes.mode == "compile" and (facts.num_experts or facts.qk_norm):
        what = experts or "q/k-norm "
        problems.append(
            f"shapes.mode: compile mode traces the dense Llama-family layer so far; {name}'s "
            f"{what}layers run eager — use eager"
        )
    return problems


def _cross_section_problems(config: EngineConfig, max_model_len: int | None) -> list[str]:
    problems: list[str] = []
    if max_model_len is None:
        return problems
    kv_len = config.kv_cache.max_seq_len
    if kv_len is not None and kv_len > max_model_len:
        problems.append(
            f"kvCache.maxSeqLen ({kv_len}) exceeds the model length ({max_model_len}); "
            "lower it or raise model.maxModelLen"
        )
    sched = config.scheduler
    if not sched.chunked_prefill and sched.max_num_batched_tokens < max_model_len:
        problems.append(
            f"scheduler.maxNumBatchedTokens ({sched.max_num_batched_tokens}) is below the model "
            f"length ({max_model_len}) with chunkedPrefill off, so a long prompt could never "
            "run; raise it or turn chunkedPrefill on"
        )
    for i, pattern in enumerate(config.shapes.patterns):
        if pattern.input_len + pattern.output_len > max_model_len:
            problems.append(
                f"shapes.patterns[{i}] ({pattern.input_len} + {pattern.output_len} tokens) "
                f"exceeds the model length ({max_model_len})"
            )
    return problems


def parse_engine_config(data: Mapping[str, Any], source: str = "engine config") -> EngineConfig:
    """Validate a mapping (camelCase or snake_case keys); ``ConfigError`` names every bad field."""
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as exc:
        lines = describe_errors(EngineConfig, exc)
        raise ConfigError(f"invalid {source}:\n  " + "\n  ".join(lines)) from None


def load_engine_config(path: str | Path) -> EngineConfig:
    """Read an engine configuration file (YAML or JSON), such as the one the operator mounts."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read engine config {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"engine config {path} is not valid YAML or JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"engine config {path} must hold a mapping with at least `model: {{uri: ...}}`"
        )
    return parse_engine_config(data, source=f"engine config {path}")


def dump_engine_config(config: EngineConfig, fmt: Literal["yaml", "json"] = "yaml") -> str:
    """The file form: camelCase keys, every value explicit (defaults included) so a reader
    sees exactly what the engine runs with."""
    data = config.model_dump(mode="json", by_alias=True, exclude_none=True)
    if fmt == "json":
        return json.dumps(data, indent=2, sort_keys=False) + "\n"
    return yaml.safe_dump(data, sort_keys=False)
