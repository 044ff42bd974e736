"""Pure functions from an ``LLMInference`` to the Kubernetes objects that run it."""

from brook_operator.render.config_map import ENGINE_CONFIG_FILE, engine_config_map
from brook_operator.render.labels import child_labels, selector_labels

__all__ = ["ENGINE_CONFIG_FILE", "child_labels", "engine_config_map", "selector_labels"]
