"""The Kubernetes permissions the operator used, collected over every operator integration
test (each module adds to it), so that the last test can compare them with ``rbac.py``."""

from __future__ import annotations

from .kube_api import KubeApi

OPERATOR_AGENTS = ("brook-operator", "kopf")

#: (verb, group, resource) of every request the operator made in this test session.
USED: set[tuple[str, str, str]] = set()


def record_rbac(api: KubeApi) -> None:
    for agent in OPERATOR_AGENTS:
        USED.update((c.verb, c.api_group, c.resource) for c in api.rbac(user_agent=agent))
