"""What the operator adds to every LLMInference it renders: images and fixed ports."""

from __future__ import annotations

from dataclasses import dataclass, field

from brook_operator import __version__

#: Port of torch.distributed's TCP store on a replica's leader pod.
RENDEZVOUS_PORT = 29500


def _fetchers() -> dict[str, str]:
    return {
        "s3": "docker.io/amazon/aws-cli:2.22.35",
        "oci": "ghcr.io/oras-project/oras:v1.2.2",
    }


@dataclass(frozen=True)
class OperatorSettings:
    """The operator's own configuration (its command-line flags)."""

    engine_image: str = f"ghcr.io/brook-dev/brook-engine:{__version__}"
    """Engine image of resources that set no spec.image. It also fetches hf:// models."""

    fetcher_images: dict[str, str] = field(default_factory=_fetchers)
    """Init-container image per model URI scheme it does not fetch with the engine image:
    s3 (the AWS CLI) and oci (ORAS)."""

    model_cache_size_limit: str | None = None
    """sizeLimit of the emptyDir that fetched models land in (node disk when unset)."""

    shm_size_limit: str = "16Gi"
    """sizeLimit of the shared-memory emptyDir at /dev/shm (torch workers and HCCL use it)."""
