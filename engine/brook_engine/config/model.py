"""Which model to serve and how to read it."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from brook_engine.config.base import Section

#: URI schemes a model may come from. A plain path (no scheme) means a local folder.
MODEL_URI_SCHEMES = ("file", "pvc", "hf", "s3", "oci")

ModelDType = Literal["auto", "bfloat16", "float16", "float32"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


#: What the engine reads of a model repository: its configuration, weights and tokenizer —
#: not the other formats' copies (GGUF, PyTorch .bin, ONNX) many repositories also carry.
#: Downloads take only these unless told otherwise.
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")
#: Where ``brook-engine fetch --progress-port`` serves a download's progress (JSON), which
#: the operator reads into ``status.modelDownload``.
DOWNLOAD_PROGRESS_PATH = "/download"


def split_model_uri(uri: str) -> tuple[str, str]:
    """``hf://org/name`` → ``("hf", "org/name")``; a plain path → ``("file", path)``."""
    match = _SCHEME.match(uri)
    if match is None:
        return "file", uri
    return match.group(1).lower(), match.group(2)


class ModelConfig(Section):
    """The model: where its Hugging Face folder comes from and how to load it."""

    uri: str = Field(min_length=1, max_length=1024)
    """Where the model lives: a local folder, or file://PATH, pvc://CLAIM/PATH,
    hf://ORG/NAME, s3://BUCKET/PREFIX, oci://REGISTRY/REPO:TAG."""

    revision: str | None = Field(default=None, max_length=256)
    """Revision of an hf:// model (branch, tag or commit); ignored for other sources."""

    tokenizer: str | None = Field(default=None, max_length=1024)
    """Folder holding tokenizer.json when it is not beside the weights."""

    served_name: str | None = Field(default=None, max_length=253)
    """Name clients use in the OpenAI API's `model` field; defaults to the model folder's
    name."""

    dtype: ModelDType = "auto"
    """Compute dtype of weights and activations. auto: bfloat16 on NPU, CUDA and CPUs with
    native bfloat16 (AVX512-BF16, AMX), float32 on other CPUs."""

    max_model_len: int | None = Field(default=None, ge=1, le=1_048_576)
    """Longest sequence (prompt + output) accepted, in tokens; defaults to the model's
    max_position_embeddings."""

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        scheme, rest = split_model_uri(uri)
        if scheme not in MODEL_URI_SCHEMES:
            allowed = ", ".join(f"{s}://" for s in MODEL_URI_SCHEMES)
            raise ValueError(
                f"scheme {scheme!r} is not supported; use one of {allowed} or a local path"
            )
        if not rest.strip("/"):
            raise ValueError(f"{uri!r} names no model; add the path after {scheme}://")
        return uri
