"""A small client for the Kubernetes API calls the operator makes."""

from brook_operator.kube.client import (
    AUTOSCALER_MANAGER,
    FIELD_MANAGER,
    STATUS_MANAGER,
    KubeClient,
    KubeError,
    resource_path,
)

__all__ = [
    "AUTOSCALER_MANAGER",
    "FIELD_MANAGER",
    "STATUS_MANAGER",
    "KubeClient",
    "KubeError",
    "resource_path",
]
