"""Labels every child object carries."""

from __future__ import annotations

from brook_operator import __version__
from brook_operator.api import LLMInference

INSTANCE_LABEL = "brook.dev/llminference"
#: leader (serves the API; the only pod of a single-pod replica) or worker.
ROLE_LABEL = "brook.dev/role"


def selector_labels(llmi: LLMInference) -> dict[str, str]:
    """The labels that select this resource's engine pods (stable across versions)."""
    return {"app.kubernetes.io/name": "brook-engine", INSTANCE_LABEL: llmi.metadata.name}


def child_labels(llmi: LLMInference) -> dict[str, str]:
    return {
        **selector_labels(llmi),
        "app.kubernetes.io/instance": llmi.metadata.name,
        "app.kubernetes.io/managed-by": "brook-operator",
        "app.kubernetes.io/version": __version__,
    }
