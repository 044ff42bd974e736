"""The ConfigMap that carries the engine's configuration file into the pods."""

from __future__ import annotations

from typing import Any

from brook_engine.config import dump_engine_config
from brook_operator.api import LLMInference, to_engine_config
from brook_operator.render.labels import child_labels

#: File name of the engine configuration inside the ConfigMap (and the mounted folder).
ENGINE_CONFIG_FILE = "engine.yaml"


def engine_config_map(llmi: LLMInference) -> dict[str, Any]:
    """``<name>-engine``: the ``EngineConfig`` every engine pod of ``llmi`` runs with."""
    metadata: dict[str, Any] = {"name": f"{llmi.metadata.name}-engine"}
    if llmi.metadata.namespace:
        metadata["namespace"] = llmi.metadata.namespace
    metadata["labels"] = child_labels(llmi)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata,
        "data": {ENGINE_CONFIG_FILE: dump_engine_config(to_engine_config(llmi.spec))},
    }
