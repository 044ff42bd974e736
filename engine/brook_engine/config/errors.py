"""Turn pydantic's validation errors into one line per problem: the field's path on the wire
(camelCase, as the user wrote it), what is wrong, and the fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

_PREFIXES = ("Value error, ", "Assertion failed, ")


def field_path(loc: Sequence[int | str], prefix: str = "") -> str:
    """``("kvCache", "layerPolicies", 0, "dtype")`` → ``kvCache.layerPolicies[0].dtype``."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else part
    return path


def _model_at(root: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The model class that holds the field at ``loc`` (a path of wire names and indexes)."""
    current: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        by_alias = {f.alias or name: f for name, f in current.model_fields.items()}
        field = by_alias.get(part) or current.model_fields.get(part)
        if field is None:
            return None
        current = _unwrap(field.annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    """``list[X] | None`` → ``X``: the model a field's values are made of, if any."""
    for arg in (*get_args(annotation), annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        if get_origin(arg) is not None:
            inner = _unwrap(arg)
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return annotation


def error_path(error: ErrorDetails, prefix: str = "") -> str:
    """The wire path of the field one pydantic error is about."""
    return field_path(error["loc"], prefix)


def error_message(root: type[BaseModel], error: ErrorDetails) -> str:
    """What is wrong, without the path: unknown fields list the known ones."""
    loc = error["loc"]
    if error["type"] == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        known = sorted(f.alias or n for n, f in parent.model_fields.items()) if parent else []
        return "unknown field" + (f"; known fields: {', '.join(known)}" if known else "")
    message = error["msg"]
    for text in _PREFIXES:
        message = message.removeprefix(text)
    value = error.get("input")
    if error["type"] != "missing" and not isinstance(value, dict | list):
        message = f"{message} (got {value!r})"
    return message


def describe_error(root: type[BaseModel], error: ErrorDetails, prefix: str = "") -> str:
    """One line for one pydantic error, naming the field on the wire."""
    path = error_path(error, prefix)
    message = error_message(root, error)
    return f"{path}: {message}" if path else message


def describe_errors(root: type[BaseModel], exc: ValidationError, prefix: str = "") -> list[str]:
    return [describe_error(root, error, prefix) for error in exc.errors()]
