"""The four patch formats of PATCH requests (server-side apply lives in :mod:`.apply`).

* ``application/merge-patch+json``: RFC 7386, exactly.
* ``application/json-patch+json``: RFC 6902, all six operations incl. ``test``.
* ``application/strategic-merge-patch+json``: an APPROXIMATION. The real server reads the
  merge keys and strategies from the Go types; here lists merge by a fixed table of field
  names (``containers``/``env``/``volumes`` … by ``name``, ``ports`` by ``containerPort`` or
  ``port``, ``conditions`` by ``type``, ``ownerReferences`` by ``uid``; ``finalizers`` is a
  merged set), whatever the type; every other list is replaced. The directives ``$patch``
  (``replace``/``delete``/``merge``), ``$setElementOrder/<list>``,
  ``$deleteFromPrimitiveList/<list>`` and ``$retainKeys`` are understood.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from . import errors


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# -- strategic merge patch (approximation) -----------------------------------------------

#: List field name → merge key(s): the first key present in the patch's items is used.
MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "volumeDevices": ("devicePath",),
    "imagePullSecrets": ("name",),
    "ports": ("containerPort", "port"),
    "conditions": ("type",),
    "ownerReferences": ("uid",),
    "hostAliases": ("ip",),
    "topologySpreadConstraints": ("topologyKey",),
    "resourceClaims": ("name",),
}
#: Primitive lists with the ``merge`` strategy (a set union), by field name.
MERGED_PRIMITIVE_LISTS = frozenset({"finalizers"})

_ORDER = "$setElementOrder/"
_DELETE_PRIMITIVE = "$deleteFromPrimitiveList/"


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    original = target if isinstance(target, Mapping) else {}
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    result: dict[str, Any] = dict(original)
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith((_ORDER, _DELETE_PRIMITIVE)):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value)
        elif isinstance(value, Mapping):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = value
    for key, value in patch.items():
        if key.startswith(_DELETE_PRIMITIVE):
            field = key[len(_DELETE_PRIMITIVE) :]
            if isinstance(result.get(field), list):
                result[field] = [item for item in result[field] if item not in value]
        elif key.startswith(_ORDER):
            field = key[len(_ORDER) :]
            if isinstance(result.get(field), list):
                result[field] = _reorder(field, result[field], value)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_key(field: str, items: list[Any]) -> str | None:
    for key in MERGE_KEYS.get(field, ()):
        if items and all(isinstance(i, Mapping) and key in i for i in items):
            return key
    return None


def _merge_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    existing = list(current) if isinstance(current, list) else []
    if any(isinstance(i, Mapping) and i.get("$patch") == "replace" for i in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, Mapping) and "$patch" in i)]
    if field in MERGED_PRIMITIVE_LISTS and all(not isinstance(i, Mapping) for i in patch):
        return existing + [i for i in patch if i not in existing]
    key = _merge_key(field, [i for i in patch if isinstance(i, Mapping)])
    if key is None or not all(isinstance(i, Mapping) and key in i for i in existing):
        return [copy.deepcopy(i) for i in patch]
    merged = [dict(i) for i in existing]
    for item in patch:
        index = next((n for n, e in enumerate(merged) if e.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del merged[index]
        elif index is None:
            merged.append(strategic_merge_patch({}, item))
        else:
            merged[index] = strategic_merge_patch(merged[index], item)
    return merged


def _reorder(field: str, items: list[Any], order: list[Any]) -> list[Any]:
    if all(not isinstance(i, Mapping) for i in order):
        ranked = {value: n for n, value in enumerate(order)}
        return sorted(items, key=lambda i: ranked.get(i, len(ranked)))
    key = _merge_key(field, order)
    if key is None:
        return items
    ranked = {o[key]: n for n, o in enumerate(order)}
    return sorted(items, key=lambda i: ranked.get(i.get(key), len(ranked)))


# -- JSON patch (RFC 6902) ---------------------------------------------------------------


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise errors.unprocessable(f"invalid JSON pointer: {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list[Any], token: str, *, adding: bool) -> int:
    if adding and token == "-":
        return len(container)
    if not token.isdigit():
        raise errors.unprocessable(f"invalid array index: {token!r}")
    index = int(token)
    if index > len(container) or (not adding and index == len(container)):
        raise errors.unprocessable(f"array index out of range: {index}")
    return index


def _parent(doc: Any, parts: list[str], path: str) -> Any:
    current = doc
    for token in parts[:-1]:
        if isinstance(current, dict) and token in current:
            current = current[token]
        elif isinstance(current, list):
            current = current[_index(current, token, adding=False)]
        else:
            raise errors.unprocessable(f'doc is missing path: "{path}"')
    return current


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent = _parent(doc, parts, path)
    token = parts[-1]
    if isinstance(parent, dict) and token in parent:
        return parent[token]
    if isinstance(parent, list):
        return parent[_index(parent, token, adding=False)]
    raise errors.unprocessable(f'doc is missing path: "{path}"')


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    parent = _parent(doc, parts, path)
    token = parts[-1]
    if isinstance(parent, dict) and token in parent:
        return parent.pop(token)
    if isinstance(parent, list):
        return parent.pop(_index(parent, token, adding=False))
    raise errors.unprocessable(f"Unable to remove nonexistent key: {token}: missing value")


def _add(doc: Any, path: str, value: Any, *, replace: bool = False) -> Any:
    parts = _pointer(path)
    if not parts:
        return copy.deepcopy(value)
    parent = _parent(doc, parts, path)
    token = parts[-1]
    if isinstance(parent, dict):
        if replace and token not in parent:
            raise errors.unprocessable(
                f'replace operation does not apply: doc is missing key: "{path}"'
            )
        parent[token] = copy.deepcopy(value)
    elif isinstance(parent, list):
        if replace:
            parent[_index(parent, token, adding=False)] = copy.deepcopy(value)
        else:
            parent.insert(_index(parent, token, adding=True), copy.deepcopy(value))
    else:
        raise errors.unprocessable(f'doc is missing path: "{path}"')
    return doc


def json_patch(target: Any, operations: Any) -> Any:
    """Apply RFC 6902 operations to a copy of ``target``; any failure is 422, as the real
    server answers (kopf relies on it for its ``test`` of ``/metadata/resourceVersion``)."""
    if not isinstance(operations, list):
        raise errors.bad_request(
            f"a json patch must be a JSON array of operations, not a JSON "
            f"{errors.json_type(operations)}"
        )
    doc = copy.deepcopy(target)
    for operation in operations:
        if not isinstance(operation, Mapping) or "op" not in operation:
            raise errors.bad_request(f"invalid json patch operation: {operation!r}")
        op, path = operation["op"], str(operation.get("path", ""))
        if op == "add":
            doc = _add(doc, path, operation.get("value"))
        elif op == "remove":
            _remove(doc, path)
        elif op == "replace":
            doc = _add(doc, path, operation.get("value"), replace=True)
        elif op == "move":
            value = _remove(doc, str(operation["from"]))
            doc = _add(doc, path, value)
        elif op == "copy":
            doc = _add(doc, path, _get(doc, str(operation["from"])))
        elif op == "test":
            if _get(doc, path) != operation.get("value"):
                raise errors.unprocessable(
                    f"the server rejected our request due to an error in our request: "
                    f"testing value {path} failed"
                )
        else:
            raise errors.bad_request(f"unsupported json patch operation: {op!r}")
    return doc
