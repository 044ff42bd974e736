"""URL paths of the Kubernetes API, parsed (kmock's own parser breaks on ``/api/v1/namespaces``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """What a path addresses. ``kind`` is one of: ``root``, ``version``, ``health``, ``api``,
    ``apis``, ``group``, ``group-version``, ``resource``, ``openapi-v2``, ``openapi-v3``,
    ``openapi-v3-gv``, ``unknown``."""

    kind: str
    group: str | None = None
    version: str | None = None
    plural: str | None = None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    #: The path on the pod (service, node) of a ``proxy`` subresource: ``/metrics``.
    proxy_path: str | None = None

    @property
    def is_resource(self) -> bool:
        return self.kind == "resource"


def _resource(group: str, version: str, parts: list[str], trailing_slash: bool) -> Target:
    namespace: str | None = None
    rest = parts
    if parts[0] == "namespaces":
        if group == "" and (len(parts) <= 2 or (len(parts) == 3 and parts[2] == "status")):
            rest = parts  # the namespaces resource itself
        elif len(parts) >= 3:
            namespace, rest = parts[1], parts[2:]
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    if rest[2:3] == ["proxy"]:
        # What follows ``proxy`` is the path on the pod, not part of the subresource: RBAC
        # checks ``pods/proxy`` whatever the path.
        proxy_path = "/" + "/".join(rest[3:])
        if trailing_slash and rest[3:]:
            proxy_path += "/"
        return Target("resource", group, version, plural, namespace, name, "proxy", proxy_path)
    subresource = "/".join(rest[2:]) or None
    return Target("resource", group, version, plural, namespace, name, subresource)


def parse(path: str) -> Target:
    parts = [p for p in path.split("/") if p]
    if not parts:
        return Target("root")
    head = parts[0]
    if head == "version" and len(parts) == 1:
        return Target("version")
    if head in ("healthz", "livez", "readyz"):
        return Target("health")
    if head == "openapi":
        if parts[1:2] == ["v2"]:
            return Target("openapi-v2")
        if parts[1:2] == ["v3"]:
            rest = parts[2:]
            if not rest:
                return Target("openapi-v3")
            if rest[0] == "api" and len(rest) == 2:
                return Target("openapi-v3-gv", "", rest[1])
            if rest[0] == "apis" and len(rest) == 3:
                return Target("openapi-v3-gv", rest[1], rest[2])
        return Target("unknown")
    if head == "api":
        if len(parts) == 1:
            return Target("api")
        if len(parts) == 2:
            return Target("group-version", "", parts[1])
        return _resource("", parts[1], parts[2:], path.endswith("/"))
    if head == "apis":
        if len(parts) == 1:
            return Target("apis")
        if len(parts) == 2:
            return Target("group", parts[1])
        if len(parts) == 3:
            return Target("group-version", parts[1], parts[2])
        return _resource(parts[1], parts[2], parts[3:], path.endswith("/"))
    return Target("unknown")
