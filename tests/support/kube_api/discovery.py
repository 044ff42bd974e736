"""Discovery (``/api``, ``/apis``, ``/apis/{group}[/{version}]``, ``/version``) and a minimal
OpenAPI v3 (``/openapi/v3`` and one document per group/version).

Discovery is the legacy (unaggregated) form: kubectl and client-go fall back to it when the
answer is not ``apidiscovery.k8s.io/v2``. The OpenAPI v3 documents list every path with its
operations, the ``x-kubernetes-group-version-kind`` of each, and the ``fieldValidation``
query parameter on PATCH: that is what kubectl checks to decide that the server validates
fields itself, so ``kubectl apply``/``create`` work without ``--validate=false`` and without
``/openapi/v2`` (which is answered 404, as a server without it would). CRD schemas are
included as component schemas; built-in kinds get empty object schemas (``kubectl explain``
does not work for them).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .resources import SUBRESOURCE_VERBS, Registry, ResourceSpec

JsonObject = dict[str, Any]

SERVER_VERSION: JsonObject = {
    "major": "1",
    "minor": "36",
    "gitVersion": "v1.36.0",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-04-22T00:00:00Z",
    "goVersion": "go1.26.2",
    "compiler": "gc",
    "platform": "linux/amd64",
    "emulator": "tests/support/kube_api (kmock)",
}


def api_versions(address: str) -> JsonObject:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
    }


def _group(registry: Registry, group: str) -> JsonObject:
    versions = registry.versions(group)
    listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": listed, "preferredVersion": listed[0]}


def api_group_list(registry: Registry) -> JsonObject:
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [_group(registry, g) for g in registry.groups()],
    }


def api_group(registry: Registry, group: str) -> JsonObject | None:
    if group not in registry.groups():
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(registry, group)}


def _resource_entries(spec: ResourceSpec) -> list[JsonObject]:
    main: JsonObject = {
        "name": spec.plural,
        "singularName": spec.singular,
        "namespaced": spec.namespaced,
        "kind": spec.kind,
        "verbs": list(spec.verbs),
    }
    if spec.short_names:
        main["shortNames"] = list(spec.short_names)
    if spec.categories:
        main["categories"] = list(spec.categories)
    main["storageVersionHash"] = hashlib.sha256(
        f"{spec.group}/{spec.storage_version}/{spec.kind}".encode()
    ).hexdigest()[:11]
    entries = [main]
    for sub in spec.subresources():
        entry: JsonObject = {
            "name": f"{spec.plural}/{sub}",
            "singularName": "",
            "namespaced": spec.namespaced,
            "kind": spec.kind,
            "verbs": list(SUBRESOURCE_VERBS),
        }
        if sub == "scale":
            entry.update({"group": "autoscaling", "version": "v1", "kind": "Scale"})
        entries.append(entry)
    return entries


def api_resource_list(registry: Registry, group: str, version: str) -> JsonObject | None:
    specs = registry.in_group_version(group, version)
    if not specs:
        return None
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": [entry for spec in specs for entry in _resource_entries(spec)],
    }


# -- OpenAPI v3 -----------------------------------------------------------------------------


def _group_versions(registry: Registry) -> list[tuple[str, str]]:
    seen: dict[tuple[str, str], None] = {}
    for spec in registry:
        seen.setdefault((spec.group, spec.version), None)
    return list(seen)


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def openapi_root(registry: Registry) -> JsonObject:
    paths: JsonObject = {}
    for group, version in _group_versions(registry):
        doc = openapi_group_version(registry, group, version)
        digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32].upper()
        paths[_gv_path(group, version)] = {
            "serverRelativeURL": f"/openapi/v3/{_gv_path(group, version)}?hash={digest}"
        }
    return {"paths": paths}


def _schema_name(spec: ResourceSpec) -> str:
    reversed_group = ".".join(reversed(spec.group.split("."))) if spec.group else "io.k8s.api.core"
    return f"{reversed_group}.{spec.version}.{spec.kind}"


def _param(name: str, where: str = "query") -> JsonObject:
    return {"name": name, "in": where, "schema": {"type": "string", "uniqueItems": True}}


def _operation(spec: ResourceSpec, action: str, params: list[str], body: list[str]) -> JsonObject:
    ref = {"$ref": f"#/components/schemas/{_schema_name(spec)}"}
    operation: JsonObject = {
        "operationId": f"{action}{spec.kind}",
        "parameters": [_param(p) for p in params],
        "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": ref}}}
        },
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {
            "group": spec.group,
            "version": spec.version,
            "kind": spec.kind,
        },
    }
    if body:
        operation["requestBody"] = {"content": {media: {"schema": ref} for media in body}}
    return operation


_WRITE = ["dryRun", "fieldManager", "fieldValidation"]
_PATCH_MEDIA = [
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/apply-patch+yaml",
]


def openapi_group_version(registry: Registry, group: str, version: str) -> JsonObject | None:
    specs = registry.in_group_version(group, version)
    if not specs:
        return None
    prefix = f"/{_gv_path(group, version)}"
    paths: JsonObject = {}
    schemas: JsonObject = {}
    for spec in specs:
        scope = f"{prefix}/namespaces/{{namespace}}" if spec.namespaced else prefix
        collection = f"{scope}/{spec.plural}"
        item = f"{collection}/{{name}}"
        paths[collection] = {
            "get": _operation(spec, "list", ["labelSelector", "fieldSelector", "watch"], []),
            "post": _operation(spec, "post", _WRITE, ["application/json"]),
        }
        item_ops = {
            "get": _operation(spec, "get", [], []),
            "put": _operation(spec, "put", _WRITE, ["application/json"]),
            "patch": _operation(spec, "patch", [*_WRITE, "force"], _PATCH_MEDIA),
            "delete": _operation(spec, "delete", ["dryRun", "propagationPolicy"], []),
        }
        paths[item] = item_ops
        for sub in ("status",) if spec.status else ():
            paths[f"{item}/{sub}"] = dict(item_ops)
        schema: JsonObject = dict(spec.schema) if spec.schema else {"type": "object"}
        schema["x-kubernetes-group-version-kind"] = [
            {"group": spec.group, "version": spec.version, "kind": spec.kind}
        ]
        schemas[_schema_name(spec)] = schema
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": SERVER_VERSION["gitVersion"]},
        "paths": paths,
        "components": {"schemas": schemas},
    }
