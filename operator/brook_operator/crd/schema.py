"""Pydantic model → Kubernetes structural OpenAPI v3 schema.

Pydantic writes JSON Schema 2020-12 with ``$ref``s, ``anyOf`` nullables and numeric
``exclusiveMinimum``; the API server wants a structural schema: everything inlined, one type
per node, OpenAPI 3.0 keywords. Defaults come from the models themselves: a section that
defaults to its own defaults becomes ``default: {}`` so the API server fills it field by field.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, get_args

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from brook_operator.api.cel_rules import CEL_RULES

Schema = dict[str, Any]

_DROP = {"title", "additionalProperties", "$defs"}
_KEEP_VALUE_KEYS = {
    "type",
    "description",
    "enum",
    "minimum",
    "maximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "pattern",
    "format",
    "items",
    "properties",
    "required",
    "default",
}


class SchemaError(RuntimeError):
    """A model uses a type the structural schema cannot express."""


def structural_schema(model: type[BaseModel]) -> Schema:
    """The structural schema of ``model`` with defaults and CEL rules."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs: dict[str, Schema] = raw.get("$defs", {})
    classes = {cls.__name__: cls for cls in _models_under(model)}
    return _convert(raw, defs, classes, model)


def _models_under(model: type[BaseModel]) -> Iterator[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    stack = [model]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        yield cls
        for field in cls.model_fields.values():
            stack.extend(_nested_models(field.annotation))


def _nested_models(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from _nested_models(arg)


def _convert(
    node: Schema,
    defs: dict[str, Schema],
    classes: dict[str, type[BaseModel]],
    model: type[BaseModel] | None = None,
) -> Schema:
    node = dict(node)
    ref = node.pop("$ref", None)
    if ref is None and len(node.get("allOf", ())) == 1:
        ref = node.pop("allOf")[0]["$ref"]
    if ref is not None:
        name = ref.rsplit("/", 1)[-1]
        target = _convert(defs[name], defs, classes, classes[name])
        target.update({k: v for k, v in node.items() if k in ("description", "default")})
        return _ordered(target)
    if "anyOf" in node:
        node = _merge_any_of(node, defs, classes)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "exclusiveMinimum" in node and not isinstance(node["exclusiveMinimum"], bool):
        node["minimum"] = node["exclusiveMinimum"]
        node["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node and not isinstance(node["exclusiveMaximum"], bool):
        node["maximum"] = node["exclusiveMaximum"]
        node["exclusiveMaximum"] = True
    if node.get("default", 0) is None:
        del node["default"]
    extra = node.get("additionalProperties")
    out: Schema = {
        k: v
        for k, v in node.items()
        if k not in _DROP
        and (k in _KEEP_VALUE_KEYS or k.startswith("x-kubernetes") or k.startswith("exclusive"))
    }
    if "description" in out:
        out["description"] = " ".join(out["description"].split())
    if node.get("type") == "object" and extra not in (None, False):
        if extra is True or extra == {}:
            out["x-kubernetes-preserve-unknown-fields"] = True
        else:
            out["additionalProperties"] = _convert(extra, defs, classes)
    if "items" in out:
        out["items"] = _convert(out["items"], defs, classes)
    if "properties" in out:
        out["properties"] = {
            key: _convert(value, defs, classes) for key, value in out["properties"].items()
        }
    if model is not None:
        _apply_model(out, model)
    return _ordered(out)


_FIRST = ("description", "type")
_LAST = ("required", "properties", "items", "additionalProperties", "x-kubernetes-validations")


def _ordered(node: Schema) -> Schema:
    """Description and type first, nested schemas last: the order a reader scans."""
    middle = sorted(k for k in node if k not in _FIRST and k not in _LAST)
    return {k: node[k] for k in (*_FIRST, *middle, *_LAST) if k in node}


def _merge_any_of(node: Schema, defs: dict[str, Schema], classes: dict[str, Any]) -> Schema:
    options = [o for o in node.pop("anyOf") if o != {"type": "null"}]
    types = sorted(o.get("type", "") for o in options)
    if types == ["integer", "string"]:
        node["x-kubernetes-int-or-string"] = True
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return node
    if len(options) != 1:
        raise SchemaError(f"cannot express anyOf {options} in a structural schema")
    merged = _convert(options[0], defs, classes)
    merged.update({k: v for k, v in node.items() if k in ("description", "default")})
    return _ordered(merged)


def _apply_model(out: Schema, model: type[BaseModel]) -> None:
    """Defaults from the model's fields, its docstring, and its CEL rules."""
    if model.__doc__ and "description" not in out:
        out["description"] = " ".join(model.__doc__.split())
    properties: Schema = out.get("properties", {})
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key in properties:
            default = _field_default(field)
            if default is not PydanticUndefined:
                properties[key]["default"] = default
            else:
                properties[key].pop("default", None)
            properties[key] = _ordered(properties[key])
    rules = CEL_RULES.get(model)
    if rules:
        out["x-kubernetes-validations"] = [rule.to_schema() for rule in rules]
    out.update(_ordered(out))


def _field_default(field: FieldInfo) -> Any:
    """The default for the API server to apply, or ``PydanticUndefined`` for none."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined or field.default is None:
        return PydanticUndefined
    else:
        value = field.default
    if isinstance(value, BaseModel):
        # A section defaulting to its own defaults: {} lets the API server fill each field.
        if value == type(value)():
            return {}
        return value.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return [v.model_dump(mode="json", by_alias=True, exclude_none=True) for v in value]
    return copy.deepcopy(value)
