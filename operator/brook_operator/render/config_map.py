"""The ConfigMap that carries the engine's configuration file into the pods."""

from __future__ import annotations

from typing import Any

from brook_engine.config import EngineConfig, ModelConfig, dump_engine_config
from brook_operator.api import LLMInference, to_engine_config
from brook_operator.render.labels import child_labels
from brook_operator.render.model_source import model_source
from brook_operator.render.settings import OperatorSettings

#: File name of the engine configuration inside the ConfigMap (and the mounted folder).
ENGINE_CONFIG_FILE = "engine.yaml"


def config_map_name(llmi: LLMInference) -> str:
    return f"{llmi.metadata.name}-engine"


def pod_engine_config(llmi: LLMInference, settings: OperatorSettings) -> EngineConfig:
    """``to_engine_config(spec)`` with the model's URI replaced by the folder the pod holds
    it in (the PVC mount, or where the init container fetched it)."""
    config = to_engine_config(llmi.spec)
    local = model_source(llmi.spec, settings).local_path
    model = ModelConfig.model_validate(
        {**config.model.model_dump(by_alias=False), "uri": f"file://{local}"}
    )
    return config.model_copy(update={"model": model})


def engine_config_map(
    llmi: LLMInference, settings: OperatorSettings | None = None
) -> dict[str, Any]:
    """``<name>-engine``: the ``EngineConfig`` every engine pod of ``llmi`` runs with."""
    settings = settings or OperatorSettings()
    metadata: dict[str, Any] = {"name": config_map_name(llmi)}
    if llmi.metadata.namespace:
        metadata["namespace"] = llmi.metadata.namespace
    metadata["labels"] = child_labels(llmi)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata,
        "data": {ENGINE_CONFIG_FILE: dump_engine_config(pod_engine_config(llmi, settings))},
    }
