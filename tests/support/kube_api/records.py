"""Every request the server received, with the RBAC attributes the real server would
authorize it by (``k8s.io/apiserver`` RequestInfo: verb, API group, resource including the
subresource, namespace)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .routing import Target


class RbacAttributes(NamedTuple):
    """Compare with plain tuples: ``("patch", "brook.dev", "llminferences/status", "ns")``."""

    verb: str
    api_group: str
    resource: str
    namespace: str | None


def k8s_verb(method: str, target: Target, query: dict[str, str]) -> str | None:
    if not target.is_resource:
        return None
    # A proxy request's query is the pod's: ``?watch=1`` there is no watch of pods.
    watching = query.get("watch") in ("true", "1") and target.subresource != "proxy"
    named = target.name is not None
    if method == "GET":
        return "watch" if watching else ("get" if named else "list")
    if method == "POST":
        return "create"
    if method == "PUT":
        return "update"
    if method == "PATCH":
        return "patch"
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    return method.lower()


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    user_agent: str
    content_type: str
    #: The parsed JSON/YAML body, if any.
    body: Any
    #: The Kubernetes verb (get, list, watch, create, update, patch, delete,
    #: deletecollection); None for non-resource paths (discovery, /version, /openapi).
    verb: str | None
    api_group: str | None
    #: The resource, with the subresource if any: ``llminferences/status``.
    resource: str | None
    namespace: str | None
    name: str | None
    #: The response code (200 as soon as a watch starts streaming; 0 while unanswered).
    status: int = 0
    #: A server-side apply that created the object (the real server also checks ``create``).
    created: bool = False

    @property
    def rbac(self) -> tuple[RbacAttributes, ...]:
        """The permission checks the real server makes for this request (empty for
        non-resource requests; two for an apply that creates: ``patch`` and ``create``)."""
        if self.verb is None or self.resource is None or self.api_group is None:
            return ()
        checks = [RbacAttributes(self.verb, self.api_group, self.resource, self.namespace)]
        if self.created and self.verb == "patch":
            checks.append(RbacAttributes("create", self.api_group, self.resource, self.namespace))
        return tuple(checks)
