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


#: Where the engine images are published, one variant per accelerator: torch's CPU build,
#: the CUDA build, and torch-npu on Ascend's CANN.
ENGINE_REPOSITORY = "ghcr.io/brook-dev/brook-engine"
ENGINE_VARIANTS = {"cpu": "", "cuda": "-cuda", "npu": "-cann"}


def _engine_images() -> dict[str, str]:
    return {
        kind: f"{ENGINE_REPOSITORY}:{__version__}{tag}" for kind, tag in ENGINE_VARIANTS.items()
    }


@dataclass(frozen=True)
class OperatorSettings:
    """The operator's own configuration (its command-line flags)."""

    engine_image: str | None = None
    """Engine image of every resource that sets no spec.image, whatever its accelerator
    (``--engine-image``); unset: the variant of ``engine_images`` for its accelerator."""

    engine_images: dict[str, str] = field(default_factory=_engine_images)
    """Engine image per accelerator type (cpu, cuda, npu) of resources that set no
    spec.image (``--engine-image-for TYPE=IMAGE``)."""

    fetcher_images: dict[str, str] = field(default_factory=_fetchers)
    """Init-container image per model URI scheme it does not fetch with the engine image:
    s3 (the AWS CLI) and oci (ORAS)."""

    model_cache_size_limit: str | None = None
    """sizeLimit of the emptyDir that fetched models land in (node disk when unset)."""

    shm_size_limit: str = "16Gi"
    """sizeLimit of the shared-memory emptyDir at /dev/shm (torch workers and HCCL use it)."""

    def image_for(self, accelerator: str) -> str:
        """The engine image of a resource on ``accelerator`` that sets no spec.image (it also
        fetches hf:// models)."""
        return self.engine_image or self.engine_images[accelerator]
