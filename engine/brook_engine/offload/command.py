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
from brook_engine.host import cpu_has_native_bf16
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


def read_config_file(path: Path) -> dict[str, Any]:
    """A model's ``config.json`` (``path`` is the file or the folder holding it)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model-config: cannot read {file}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--model-config: {file} is not a config.json object")
    return data


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
    return read_config_file(model_config)


def target_for(config: EngineConfig, memory_gb: float | None) -> Target:
    """The plan's device: the configuration's (``auto``: cpu here), its dtype (``auto``:
    bfloat16, or float32 on a CPU without native BF16, as the engine picks)."""
    device = config.device if config.device != "auto" else "cpu"
    native_bf16 = device == "cpu" and cpu_has_native_bf16()
    dtype = config.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device != "cpu" or native_bf16 else "float32"
    return Target(
        device=device,
        dtype=dtype,
        cpu_packs_float=device == "cpu" and (dtype == "float32" or native_bf16),
        cpu_tiles_int8=device == "cpu",
        device_memory_bytes=None if memory_gb is None else int(memory_gb * GIB),
    )


def plan_for(config: EngineConfig, data: dict[str, Any], target: Target) -> MemoryPlan:
    """The plan of ``config`` on the model of ``config.json`` ``data``: the configuration
    checked against the model first, a quantized checkpoint's own groups counted."""
    shape = ModelShape.from_config(data)
    config.check_against_model(shape.facts)
    return build_plan(with_checkpoint_quantization(config, data), shape, target)


def memory_plan(
    config: EngineConfig, model_config: Path | None, memory_gb: float | None
) -> MemoryPlan:
    return plan_for(config, read_model_config(config, model_config), target_for(config, memory_gb))
