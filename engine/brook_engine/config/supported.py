"""Settings this engine build cannot honour yet: refused, never ignored. Torch-free, so the
engine, ``brook validate`` and the operator can all call it."""

from __future__ import annotations

from brook_engine.config.base import ConfigError
from brook_engine.config.engine import EngineConfig


def check_supported(config: EngineConfig) -> None:
    """Raise ``ConfigError`` naming every setting this build cannot honour yet."""
    problems = []
    if config.offload.policy != "none":
        problems.append("offload.policy: weight offload is not available yet; use none")
    if config.quantization.weights != "none":
        problems.append("quantization.weights: w8a16 is not available yet; use none")
    if config.shapes.mode != "eager":
        problems.append("shapes.mode: compile is not available yet; use eager")
    if problems:
        raise ConfigError("; ".join(problems))
