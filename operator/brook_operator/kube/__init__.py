"""A small client for the Kubernetes API calls the operator makes."""

from brook_operator.kube.client import FIELD_MANAGER, KubeClient, KubeError, resource_path

__all__ = ["FIELD_MANAGER", "KubeClient", "KubeError", "resource_path"]
