"""Validate ``LLMInference`` manifests offline, the way the API server would.

Three passes, in the API server's order: the structural schema (types, enums, bounds,
patterns, and unknown fields as ``kubectl apply``'s strict field validation refuses them);
defaulting; then every CEL rule of the CRD, evaluated with a CEL library on the defaulted
object. A last pass parses the object into the pydantic models the operator uses, so nothing
the operator would refuse passes here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import celpy
import jsonschema
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError
from pydantic import ValidationError

from brook_engine.config import error_message, error_path, field_path
from brook_operator.api import API_VERSION, KIND, LLMInference
from brook_operator.crd.generate import openapi_schema

Schema = dict[str, Any]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a manifest: where, and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def validate_object(obj: Any, schema: Schema | None = None) -> list[Problem]:
    """Every problem the API server (and then the operator) would find in ``obj``.

    ``schema`` is the CRD's ``openAPIV3Schema``; the generated one when not given.
    """
    schema = schema if schema is not None else openapi_schema()
    if not isinstance(obj, dict):
        return [Problem("(document)", "not a mapping; expected an LLMInference object")]
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") != KIND:
        return [
            Problem(
                "apiVersion/kind",
                f"expected apiVersion {API_VERSION} and kind {KIND}, got "
                f"{obj.get('apiVersion')!r} and {obj.get('kind')!r}",
            )
        ]
    name = (obj.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        return [Problem("metadata.name", "required: give the resource a name")]
    obj = _without_nulls(obj)
    problems = schema_problems(obj, schema)
    if problems:
        return problems
    defaulted = apply_defaults(obj, schema)
    problems = cel_problems(defaulted, schema)
    if problems:
        return problems
    try:
        LLMInference.model_validate(obj)
    except ValidationError as exc:
        return [Problem(error_path(e), error_message(LLMInference, e)) for e in exc.errors()]
    return []


def schema_problems(obj: Any, schema: Schema) -> list[Problem]:
    """Type, enum, bound, pattern, required and unknown-field problems."""
    strict = _strict(schema)
    # metadata keeps its other fields (labels, annotations, ...): the API server owns them.
    strict.get("properties", {}).get("metadata", {}).pop("additionalProperties", None)
    validator = jsonschema.Draft4Validator(strict)
    problems: list[Problem] = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path))):
        path = field_path(list(error.absolute_path))
        if error.validator == "additionalProperties":
            known = error.schema.get("properties", {})
            for key in sorted(k for k in error.instance if k not in known):
                hint = ", ".join(sorted(known))
                problems.append(
                    Problem(
                        field_path([*error.absolute_path, key]), f"unknown field; known: {hint}"
                    )
                )
        elif error.validator == "required":
            missing = error.message.split("'")[1]
            problems.append(Problem(field_path([*error.absolute_path, missing]), "required"))
        elif error.validator == "pattern" and "description" in error.schema:
            problems.append(Problem(path, f"{error.message}: {error.schema['description']}"))
        else:
            problems.append(Problem(path, error.message))
    return problems


def apply_defaults(obj: Any, schema: Schema) -> Any:
    """A copy of ``obj`` with the schema's defaults filled in, top-down as the API server does."""
    obj = copy.deepcopy(obj)
    _default_into(obj, schema)
    return obj


def cel_problems(obj: Any, schema: Schema) -> list[Problem]:
    """Every failing ``x-kubernetes-validations`` rule, at the node that declares it."""
    problems: list[Problem] = []
    for path, node_schema, value in _walk(obj, schema, []):
        for rule in node_schema.get("x-kubernetes-validations", ()):
            target = field_path(path) if path else ""
            where = target + rule.get("fieldPath", "") if path else rule.get("fieldPath", "")
            where = where.lstrip(".") or "(object)"
            try:
                ok = _program(rule["rule"]).evaluate({"self": _to_cel(value, node_schema)})
            except CELEvalError as exc:
                problems.append(Problem(where, f"rule {rule['rule']!r} failed: {exc.args[0]}"))
                continue
            if not (isinstance(ok, celtypes.BoolType) and bool(ok)):
                problems.append(Problem(where, rule["message"]))
    return problems


@cache
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _walk(
    value: Any, schema: Schema, path: list[int | str]
) -> Iterator[tuple[list[int | str], Schema, Any]]:
    yield path, schema, value
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key, child in value.items():
            if key in properties:
                yield from _walk(child, properties[key], [*path, key])
    elif isinstance(value, list) and "items" in schema:
        for index, child in enumerate(value):
            yield from _walk(child, schema["items"], [*path, index])


def _to_cel(value: Any, schema: Schema) -> Any:
    """CEL values typed by the schema (``number`` fields are doubles even when written 1)."""
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        return celtypes.MapType(
            {celtypes.StringType(k): _to_cel(v, props.get(k, {})) for k, v in value.items()}
        )
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        inner = schema["additionalProperties"]
        return celtypes.MapType(
            {celtypes.StringType(k): _to_cel(v, inner) for k, v in value.items()}
        )
    if isinstance(value, list):
        return celtypes.ListType([_to_cel(v, schema.get("items", {})) for v in value])
    if (
        schema.get("type") == "number"
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    ):
        return celtypes.DoubleType(float(value))
    return json_to_cel(value)


def _default_into(value: Any, schema: Schema) -> None:
    if isinstance(value, dict):
        for key, child_schema in schema.get("properties", {}).items():
            if key not in value and "default" in child_schema:
                value[key] = copy.deepcopy(child_schema["default"])
            if key in value:
                _default_into(value[key], child_schema)
    elif isinstance(value, list) and "items" in schema:
        for child in value:
            _default_into(child, schema["items"])


def _without_nulls(value: Any) -> Any:
    """The API server drops null fields of non-nullable schemas; so does this."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _strict(schema: Schema) -> Schema:
    """The schema as JSON Schema draft 4, refusing unknown fields (strict field validation)."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("anyOf", None)
        out["type"] = ["integer", "string"]
    if "properties" in schema:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(schema["additionalProperties"])
    if "items" in schema:
        out["items"] = _strict(schema["items"])
    return out
