"""What a Hugging Face ``config.json`` says about a decoder, checked and normalised.

Torch-free, so configuration checks can run before anything heavy is imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from brook_engine.config import ConfigError, ModelConfig, ModelFacts, split_model_uri
from brook_engine.offload.plan import (
    QK_NORM_ARCHITECTURES,
    ExpertShape,
    ModelShape,
    has_qkv_bias,
    head_stored_int8,
)

#: Architectures the engine runs
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)

#: Rotary variants: plain, position interpolation, Llama 3.1's and YaRN.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def resolve_model_folder(model: ModelConfig) -> Path:
    """The local folder of ``model.uri``. Remote sources are fetched before the engine
    starts (in Kubernetes by the pod's init container)."""
    scheme, rest = split_model_uri(model.uri)
    if scheme != "file":
        raise ConfigError(
            f"model.uri {model.uri!r} is remote; fetch it into a local folder first (the "
            "operator's init container does this in a pod) and pass the folder's path"
        )
    folder = Path(rest).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"model.uri: {folder} is not a folder holding a Hugging Face model")
    return folder


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    o_bias: bool
    sliding_window: int | None
    rope_type: str
    rope_scaling: dict[str, Any]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    qk_norm: bool = False
    experts: ExpertShape | None = None  # mixture-of-experts layers (None: dense)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def is_sparse(self, layer: int) -> bool:
        """Whether global layer ``layer``'s FFN is the expert block."""
        return self.experts is not None and layer in self.experts.sparse_layers

    def activation_bytes(self, max_tokens: int, max_seqs: int, tensor: int, itemsize: int) -> int:
        """Bytes the largest step's activations take on one tensor rank (``ModelShape``'s)."""
        return self.shape.activation_bytes(max_tokens, max_seqs, tensor, itemsize)

    @cached_property
    def shape(self) -> ModelShape:
        """What the memory plan needs (``offload.plan``)."""
        return ModelShape(
            architecture=self.architecture,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            qkv_bias=self.qkv_bias,
            o_bias=self.o_bias,
            mlp_bias=self.mlp_bias,
            max_position_embeddings=self.max_position_embeddings,
            qk_norm=self.qk_norm,
            experts=self.experts,
            head_stored_int8=head_stored_int8(self.extra),
        )

    @property
    def facts(self) -> ModelFacts:
        return self.shape.facts

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> ModelArch:
        archs = data.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ConfigError(
                f"{source}: architectures {archs or '(none)'} are not supported; Brook runs "
                f"{supported}"
            )
        act = data.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (silu only)")
        try:
            hidden = int(data["hidden_size"])
            heads = int(data["num_attention_heads"])
            eos = data.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            window = data.get("sliding_window") if data.get("use_sliding_window", True) else None
            # transformers >= 5 writes rope_parameters (theta inside); older configs write
            # rope_theta and rope_scaling.
            rope = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
            rope_theta = float(rope.pop("rope_theta", data.get("rope_theta", 10000.0)))
            rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
            if rope_type not in ROPE_TYPES:
                raise ConfigError(
                    f"{source}: rope type {rope_type!r} is not supported; Brook runs "
                    + ", ".join(ROPE_TYPES)
                )
            if arch.startswith("Qwen") and not data.get("use_sliding_window", False):
                window = None  # Qwen configs carry a window they do not use
            experts = ExpertShape.from_config(data, arch)
            if experts is not None:
                _check_experts(experts, source)
            return cls(
                architecture=arch,
                hidden_size=hidden,
                intermediate_size=int(data["intermediate_size"]),
                num_layers=int(data["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or hidden // heads),
                vocab_size=int(data["vocab_size"]),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                qkv_bias=has_qkv_bias(data, arch),
                o_bias=bool(data.get("attention_bias", False)),
                mlp_bias=bool(data.get("mlp_bias", False)),
                sliding_window=int(window) if window else None,
                rope_type=rope_type,
                rope_scaling=rope,
                bos_token_id=data.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                torch_dtype=data.get("dtype") or data.get("torch_dtype"),
                qk_norm=arch in QK_NORM_ARCHITECTURES,
                experts=experts,
                extra=data,
            )
        except KeyError as exc:
            raise ConfigError(f"{source}: missing {exc.args[0]!r}") from None

    @classmethod
    def from_folder(cls, folder: Path) -> ModelArch:
        path = folder / "config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(
                f"{path} not found: model.uri must name a Hugging Face model folder"
            ) from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(data, source=str(path))


def _check_experts(experts: ExpertShape, source: str) -> None:
    if experts.num_experts < 1 or not 1 <= experts.experts_per_token <= experts.num_experts:
        raise ConfigError(
            f"{source}: num_experts_per_tok ({experts.experts_per_token}) must be between 1 "
            f"and the number of experts ({experts.num_experts})"
        )
    if experts.expert_size < 1:
        raise ConfigError(f"{source}: the experts' MLP width must be positive")
