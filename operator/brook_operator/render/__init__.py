"""Pure functions from an ``LLMInference`` to the Kubernetes objects that run it."""

from brook_operator.render.children import (
    OPTIONAL_KINDS,
    PRUNABLE_KINDS,
    render_children,
    with_owner,
)
from brook_operator.render.config_map import (
    ENGINE_CONFIG_FILE,
    config_map_name,
    engine_config_map,
    pod_engine_config,
)
from brook_operator.render.labels import ROLE_LABEL, child_labels, selector_labels
from brook_operator.render.services import endpoint
from brook_operator.render.settings import OperatorSettings
from brook_operator.render.workload import desired_replicas, workload_name

__all__ = [
    "ENGINE_CONFIG_FILE",
    "OPTIONAL_KINDS",
    "PRUNABLE_KINDS",
    "ROLE_LABEL",
    "OperatorSettings",
    "child_labels",
    "config_map_name",
    "desired_replicas",
    "endpoint",
    "engine_config_map",
    "pod_engine_config",
    "render_children",
    "selector_labels",
    "with_owner",
    "workload_name",
]
