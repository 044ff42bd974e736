"""``brook-engine plan``: the memory plan of a configuration, before anything is scheduled.

Reads an engine configuration file or an ``LLMInference`` manifest (its ``spec``'s engine
sections), the model's ``config.json`` (from ``--model-config``, else the configuration's
local model folder), and prints each rank's plan as a table or JSON. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from brook_engine.config import ConfigError, EngineConfig, parse_engine_config
from brook_engine.config.model import split_model_uri
from brook_engine.offload.plan import (
    GIB,
    MemoryPlan,
    ModelShape,
    Target,
    build_plan,
    with_checkpoint_quantization,
)

_ACCELERATOR_DEVICE = {"npu": "npu", "cuda": "cuda", "cpu": "cpu"}


def read_plan_config(path: Path) -> EngineConfig:
    """An engine configuration file, or the engine sections of an LLMInference manifest."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping (an engine configuration or a manifest)")
    if data.get("kind") == "LLMInference":
        spec = dict(data.get("spec") or {})
        accelerator = spec.get("accelerator") or {}
        fields = set(EngineConfig.model_fields) | {
            f.alias for f in EngineConfig.model_fields.values() if f.alias
        }
        engine = {k: _engine_part(k, v) for k, v in spec.items() if k in fields}
        engine.setdefault("device", _ACCELERATOR_DEVICE.get(accelerator.get("type", "cpu"), "cpu"))
        return parse_engine_config(engine, source=f"{path} (spec)")
    return parse_engine_config(data, source=str(path))


def _engine_part(key: str, value: Any) -> Any:
    """A spec section with only the fields the engine reads (the operator's own, such as
    ``server.apiKeySecretRef``, dropped: the operator turns those into the engine's)."""
    field = EngineConfig.model_fields.get(key) or next(
        (f for f in EngineConfig.model_fields.values() if f.alias == key), None
    )
    section = getattr(field, "annotation", None)
    known = getattr(section, "model_fields", None)
    if not isinstance(value, dict) or not known:
        return value
    names = set(known) | {f.alias for f in known.values() if f.alias}
    return {k: v for k, v in value.items() if k in names}


def read_model_config(config: EngineConfig, model_config: Path | None) -> dict[str, Any]:
    """The model's ``config.json``: ``model_config`` (a file or a folder holding one), else
    the configuration's local model folder."""
    if model_config is None:
        scheme, rest = split_model_uri(config.model.uri)
        if scheme != "file":
            raise ConfigError(
                f"model.uri {config.model.uri!r} is not a local folder; pass the model's "
                "config.json with --model-config"
            )
        model_config = Path(rest)
    path = model_config / "config.json" if model_config.is_dir() else model_config
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--model-config: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a config.json object")
    return data


def _host_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def target_for(config: EngineConfig, data: dict[str, Any], memory_gb: float | None) -> Target:
    """The plan's device: the configuration's (``auto``: cpu here), its dtype (``auto``:
    bfloat16, or float32 on a CPU without native BF16, as the engine picks)."""
    device = config.device if config.device != "auto" else "cpu"
    dtype = config.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device != "cpu" or _host_has_native_bf16() else "float32"
    return Target(
        device=device,
        dtype=dtype,
        cpu_packs_float=device == "cpu" and (dtype == "float32" or _host_has_native_bf16()),
        cpu_tiles_int8=device == "cpu",
        device_memory_bytes=None if memory_gb is None else int(memory_gb * GIB),
    )


def memory_plan(
    config: EngineConfig, model_config: Path | None, memory_gb: float | None
) -> MemoryPlan:
    data = read_model_config(config, model_config)
    shape = ModelShape.from_config(data)
    config.check_against_model(_facts(shape))
    config = with_checkpoint_quantization(config, data)
    return build_plan(config, shape, target_for(config, data, memory_gb))


def _facts(shape: ModelShape) -> Any:
    from brook_engine.config import ModelFacts

    return ModelFacts(
        num_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        intermediate_size=shape.intermediate_size,
    )
