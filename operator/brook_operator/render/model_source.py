"""Where a pod finds its model: a volume, maybe an init container that fetches it, and the
local folder the engine then loads.

- ``file://PATH``: a folder inside the image; nothing to mount.
- ``pvc://CLAIM/PATH``: the claim mounted read-only at ``/models``.
- ``hf://ORG/NAME``, ``s3://BUCKET/PREFIX``, ``oci://REGISTRY/REPO:TAG``: an init container
  downloads into an emptyDir at ``/models`` (``brook-engine fetch`` from the engine image, the
  AWS CLI, ORAS); the credentials Secret reaches only that container. hf:// and s3:// take
  only the files the engine reads (``model.include``/``exclude`` change that).
- ``hf://`` with ``model.cache``: the download goes into a folder of a shared claim, named
  after the model and revision, once for every replica (``brook-engine fetch`` locks it and
  marks it complete); the engine mounts the claim read-only.

``brook-engine fetch`` serves its progress on the API port while it runs (the engine has not
started); the operator reads it into ``status.modelDownload``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from brook_engine.config import MODEL_FILES, split_model_uri
from brook_operator.api import LLMInferenceSpec
from brook_operator.render.settings import OperatorSettings

MODELS_DIR = "/models"
MODEL_VOLUME = "model"
FETCH_CONTAINER = "fetch-model"
#: ``brook-engine fetch``'s flag serving its progress (the operator reads the port from it).
PROGRESS_PORT_FLAG = "--progress-port"
_CREDENTIALS_VOLUME = "model-credentials"
_CREDENTIALS_DIR = "/var/run/secrets/brook/model-credentials"


@dataclass(frozen=True)
class ModelSource:
    local_path: str
    """The folder the engine loads, inside the pod."""

    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    """Mounts of the engine container."""

    init_containers: list[dict[str, Any]] = field(default_factory=list)


def _fetch_container(
    name: str, image: str, command: list[str], env: list[dict[str, Any]], secret_mount: bool
) -> dict[str, Any]:
    mounts: list[dict[str, Any]] = [{"name": MODEL_VOLUME, "mountPath": MODELS_DIR}]
    if secret_mount:
        mounts.append(
            {"name": _CREDENTIALS_VOLUME, "mountPath": _CREDENTIALS_DIR, "readOnly": True}
        )
    return {
        "name": name,
        "image": image,
        "command": command,
        "env": env,
        "volumeMounts": mounts,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        # The restricted profile applies here too; HOME points at the writable volume.
        "securityContext": restricted_container_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",  # a failed download says why
    }


def restricted_container_context() -> dict[str, Any]:
    """A container security context that meets the Pod Security Standards' restricted
    profile, with a read-only root filesystem."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def model_source(spec: LLMInferenceSpec, settings: OperatorSettings) -> ModelSource:
    scheme, rest = split_model_uri(spec.model.uri)
    rest = rest.strip("/")
    if scheme == "file":
        return ModelSource(local_path="/" + rest)
    if scheme == "pvc":
        claim, _, sub_path = rest.partition("/")
        return ModelSource(
            local_path=f"{MODELS_DIR}/{sub_path}".rstrip("/"),
            volumes=[
                {
                    "name": MODEL_VOLUME,
                    "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
                }
            ],
            mounts=[{"name": MODEL_VOLUME, "mountPath": MODELS_DIR, "readOnly": True}],
        )
    local = f"{MODELS_DIR}/{rest.replace(':', '/')}"
    ref = spec.model.credentials_secret_ref
    env: list[dict[str, Any]] = [{"name": "HOME", "value": f"{MODELS_DIR}/.home"}]
    volumes: list[dict[str, Any]] = [
        {
            "name": MODEL_VOLUME,
            "emptyDir": {"sizeLimit": settings.model_cache_size_limit}
            if settings.model_cache_size_limit
            else {},
        }
    ]
    include = list(spec.model.include or MODEL_FILES)
    exclude = list(spec.model.exclude)
    secret_mount = False
    if scheme == "hf":
        if spec.model.cache is not None:
            folder = cache_folder(
                rest, spec.model.revision, spec.model.include, list(spec.model.exclude)
            )
            local = f"{MODELS_DIR}/{folder}"
            shared = {"claimName": spec.model.cache.claim_name}
            volumes = [{"name": MODEL_VOLUME, "persistentVolumeClaim": shared}]
            env = [{"name": "HOME", "value": "/tmp"}]  # not the shared claim
        command = ["brook-engine", "fetch", f"hf://{rest}", "--output", local]
        if spec.model.revision:
            command += ["--revision", spec.model.revision]
        command += [f"--include={p}" for p in include] + [f"--exclude={p}" for p in exclude]
        # its progress, on the API port the engine takes later, for status.modelDownload
        command.append(f"{PROGRESS_PORT_FLAG}={spec.server.port}")
        env.append({"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"})
        if ref is not None:
            env.append(
                {
                    "name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
                }
            )
        init = _fetch_container(
            FETCH_CONTAINER, settings.image_for(spec.accelerator.type), command, env, False
        )
        if spec.model.cache is not None:
            init["volumeMounts"].append({"name": "fetch-tmp", "mountPath": "/tmp"})
            volumes.append({"name": "fetch-tmp", "emptyDir": {}})
    else:
        if ref is not None:
            # The Secret key holds the tool's credentials file: an AWS shared-credentials
            # file for s3, a Docker config.json for oci.
            secret_mount = True
            volumes.append(
                {
                    "name": _CREDENTIALS_VOLUME,
                    "secret": {
                        "secretName": ref.name,
                        "items": [{"key": ref.key, "path": "credentials"}],
                    },
                }
            )
        credentials = f"{_CREDENTIALS_DIR}/credentials"
        if scheme == "s3":
            # aws s3 sync: later filters win — nothing, then the patterns, then the exclusions
            filters = ["--exclude", "*"]
            for pattern in include:
                filters += ["--include", pattern]
            for pattern in exclude:
                filters += ["--exclude", pattern]
            command = ["aws", "s3", "sync", "--only-show-errors", *filters, f"s3://{rest}", local]
            if secret_mount:
                env.append({"name": "AWS_SHARED_CREDENTIALS_FILE", "value": credentials})
        else:  # oci
            command = ["oras", "pull", rest, "--output", local]
            if secret_mount:
                command += ["--registry-config", credentials]
        image = settings.fetcher_images[scheme]
        init = _fetch_container(FETCH_CONTAINER, image, command, env, secret_mount)
    return ModelSource(
        local_path=local,
        volumes=volumes,
        mounts=[{"name": MODEL_VOLUME, "mountPath": MODELS_DIR, "readOnly": True}],
        init_containers=[init],
    )


def cache_folder(
    repo: str,
    revision: str | None,
    include: list[str] | None = None,
    exclude: Sequence[str] = (),
) -> str:
    """The shared claim's folder of ``repo`` at ``revision`` with these file patterns: a
    readable name (``Qwen--Qwen2.5-7B@main``), with a short digest where the revision had to
    be spelled differently or the patterns are not the default, so no two differ only there."""

    def safe(text: str) -> str:
        return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)

    rev = revision or "main"
    name = f"{safe(repo.replace('/', '--'))}@{safe(rev)}"
    if safe(rev) != rev or include is not None or exclude:
        key = json.dumps([rev, include, list(exclude)])
        name += "-" + hashlib.sha256(key.encode()).hexdigest()[:8]
    return name
