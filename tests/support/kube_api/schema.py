"""Structural-schema pruning and defaulting of custom resources, as the real server does
on every write (CRD ``openAPIV3Schema``): unknown fields are dropped unless
``x-kubernetes-preserve-unknown-fields``; ``default`` values fill absent fields (and
non-nullable nulls), top-down, so a defaulted ``{}`` gets its own nested defaults.

The lists the schema marks ``x-kubernetes-list-type: map`` (:func:`list_maps`) are merged
item by item by server-side apply (:mod:`.apply`).

NOT emulated: validation (types, required, enums, patterns, CEL ``x-kubernetes-validations``)
-- the server accepts anything structurally shaped; ``fieldValidation=Strict`` is accepted
and ignored; ``allOf``/``anyOf``/``oneOf``/``not`` are not descended.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

_ROOT_KEYS = ("apiVersion", "kind", "metadata")


def _preserves(schema: Mapping[str, Any]) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields"))


def prune(value: Any, schema: Mapping[str, Any], *, root: bool = False) -> Any:
    if isinstance(value, dict):
        properties: Mapping[str, Any] = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        embedded = root or bool(schema.get("x-kubernetes-embedded-resource"))
        result: dict[str, Any] = {}
        for key, nested in value.items():
            if embedded and key in _ROOT_KEYS:
                result[key] = nested
            elif key in properties:
                result[key] = prune(nested, properties[key])
            elif isinstance(additional, Mapping):
                result[key] = prune(nested, additional)
            elif _preserves(schema) or additional is True:
                result[key] = nested
        return result
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, Mapping):
            return [prune(item, items) for item in value]
    return value


def default(value: Any, schema: Mapping[str, Any]) -> Any:
    if isinstance(value, dict):
        properties: Mapping[str, Any] = schema.get("properties") or {}
        for key, prop in properties.items():
            if not isinstance(prop, Mapping):
                continue
            if value.get(key, None) is None and key in value and not prop.get("nullable"):
                del value[key]
            if key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
            if key in value:
                value[key] = default(value[key], prop)
        additional = schema.get("additionalProperties")
        if isinstance(additional, Mapping):
            for key in list(value):
                if key not in properties:
                    value[key] = default(value[key], additional)
        return value
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, Mapping):
            return [default(item, items) for item in value]
    return value


def list_maps(schema: Mapping[str, Any] | None) -> dict[tuple[str, ...], tuple[str, ...]]:
    """Every ``x-kubernetes-list-type: map`` list of a structural schema: its path (map keys
    only, list items add no element) → its ``x-kubernetes-list-map-keys``. The lists under
    ``additionalProperties`` (no fixed path) and inside atomic lists are not included."""
    found: dict[tuple[str, ...], tuple[str, ...]] = {}

    def walk(node: Mapping[str, Any], path: tuple[str, ...]) -> None:
        for key, prop in (node.get("properties") or {}).items():
            if isinstance(prop, Mapping):
                walk(prop, (*path, key))
        items = node.get("items")
        if node.get("x-kubernetes-list-type") == "map" and isinstance(items, Mapping):
            found[path] = tuple(node.get("x-kubernetes-list-map-keys") or ())
            walk(items, path)

    if schema:
        walk(schema, ())
    return found


def prune_and_default(obj: dict[str, Any], schema: Mapping[str, Any] | None) -> dict[str, Any]:
    if not schema:
        return obj
    pruned = prune(obj, schema, root=True)
    result = default(pruned, schema)
    assert isinstance(result, dict)
    return result
