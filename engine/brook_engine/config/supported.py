"""Settings this engine build cannot honour yet: refused, never ignored. Torch-free, so the
engine, ``brook validate`` and the operator (its SpecValid condition) all call the same
check, and the CRD carries its twin as CEL rules (``kubectl apply`` refuses them too)."""

from __future__ import annotations

from brook_engine.config.base import ConfigError
from brook_engine.config.sections import EngineSections


def unsupported_settings(sections: EngineSections) -> list[str]:
    """One message per setting this build cannot honour, naming the field and the fix."""
    problems = []
    if sections.offload.policy != "none" and sections.shapes.one_row_weights != "model":
        problems.append(
            "shapes.oneRowWeights: one-row copies would double the weights that offload "
            "keeps under its budget; use model with offload.policy "
            f"{sections.offload.policy}"
        )
    quantization = sections.quantization
    if quantization.group_size is not None and quantization.weights == "none":
        problems.append(
            "quantization.groupSize: groups apply to quantized weights; set "
            "quantization.weights: w8a16 or remove groupSize"
        )
    if sections.quantization.weights == "w8a16" and sections.shapes.one_row_weights != "model":
        problems.append(
            "shapes.oneRowWeights: one-row copies are of float weights; with "
            "quantization.weights w8a16 the int8 weights serve one row too — use model"
        )
    moe = sections.moe
    if not moe.reroute and moe.load_threshold != type(moe)().load_threshold:
        problems.append(
            "moe.loadThreshold: applies to rerouting; set moe.reroute: true or remove "
            "moe.loadThreshold"
        )
    shapes = sections.shapes
    if shapes.mode == "eager":
        defaults = type(shapes)()
        for field, name in (
            ("patterns", "patterns"),
            ("kernel_cache_size", "kernelCacheSize"),
            ("online_learning", "onlineLearning"),
            ("cache_dir", "cacheDir"),
        ):
            if getattr(shapes, field) != getattr(defaults, field):
                problems.append(
                    f"shapes.{name}: applies to compiled shapes; set shapes.mode: compile "
                    f"or remove shapes.{name}"
                )
    return problems


def check_supported(sections: EngineSections) -> None:
    """Raise ``ConfigError`` naming every setting this build cannot honour yet."""
    problems = unsupported_settings(sections)
    if problems:
        raise ConfigError("; ".join(problems))
