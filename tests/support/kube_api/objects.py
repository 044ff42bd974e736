"""Small helpers over JSON-like objects: timestamps, names, dotted paths."""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Mapping
from typing import Any

JsonObject = dict[str, Any]


def now() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)


def timestamp(moment: datetime.datetime | None = None) -> str:
    """RFC 3339 with second precision and ``Z``, as ``metav1.Time`` renders."""
    return (moment or now()).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(value: str) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def generated_name(prefix: str) -> str:
    """``generateName`` + five random characters, from the alphabet the server uses."""
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    return prefix + "".join(secrets.choice(alphabet) for _ in range(5))


def split_path(path: str) -> list[str]:
    """``.spec.model.uri`` → ``["spec", "model", "uri"]`` (simple dotted paths only)."""
    return [part for part in path.strip().lstrip(".").split(".") if part]


def get_path(obj: Mapping[str, Any], path: str | list[str]) -> Any:
    parts = split_path(path) if isinstance(path, str) else path
    current: Any = obj
    for part in parts:
        if not isinstance(current, Mapping) or part not in current:
            return None
        current = current[part]
    return current


def set_path(obj: JsonObject, path: str | list[str], value: Any) -> None:
    parts = split_path(path) if isinstance(path, str) else path
    current = obj
    for part in parts[:-1]:
        nested = current.get(part)
        if not isinstance(nested, dict):
            nested = current[part] = {}
        current = nested
    current[parts[-1]] = value


def metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def label_selector_string(selector: Mapping[str, Any] | None) -> str:
    """A ``LabelSelector`` as the selector string the scale subresource reports."""
    if not selector:
        return ""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or ():
        key, operator = expr.get("key"), expr.get("operator")
        values = ",".join(sorted(expr.get("values") or ()))
        if operator == "In":
            parts.append(f"{key} in ({values})")
        elif operator == "NotIn":
            parts.append(f"{key} notin ({values})")
        elif operator == "Exists":
            parts.append(str(key))
        elif operator == "DoesNotExist":
            parts.append(f"!{key}")
    return ",".join(parts)
