"""Label selectors (``=``, ``==``, ``!=``, ``in``, ``notin``, exists, ``!``exists, ``>``, ``<``)
and field selectors (``metadata.name``, ``metadata.namespace`` for every resource, plus the
few resource-specific fields listed in :data:`EXTRA_FIELDS`; others are a 400 as on the real
server)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import errors, objects

_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_VALUE = r"[-A-Za-z0-9_.]*"


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # "=", "!=", "in", "notin", "exists", "!exists", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.operator == "exists":
            return present
        if self.operator == "!exists":
            return not present
        if self.operator in ("=", "in"):
            return present and value in self.values
        if self.operator in ("!=", "notin"):
            return not present or value not in self.values
        try:
            number, bound = int(str(value)), int(self.values[0])
        except ValueError:
            return False
        return number > bound if self.operator == "gt" else number < bound


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current = ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part.strip() for part in parts if part.strip()]


def parse_label_selector(text: str) -> list[Requirement]:
    requirements: list[Requirement] = []
    for part in _split_top_level(text or ""):
        if match := re.fullmatch(rf"({_KEY})\s+(in|notin)\s+\(([^)]*)\)", part):
            values = tuple(v.strip() for v in match.group(3).split(",") if v.strip())
            requirements.append(Requirement(match.group(1), match.group(2), values))
        elif match := re.fullmatch(rf"({_KEY})\s*(==|=|!=)\s*({_VALUE})", part):
            operator = "!=" if match.group(2) == "!=" else "="
            requirements.append(Requirement(match.group(1), operator, (match.group(3),)))
        elif match := re.fullmatch(rf"({_KEY})\s*([<>])\s*(-?\d+)", part):
            operator = "gt" if match.group(2) == ">" else "lt"
            requirements.append(Requirement(match.group(1), operator, (match.group(3),)))
        elif match := re.fullmatch(rf"!\s*({_KEY})", part):
            requirements.append(Requirement(match.group(1), "!exists"))
        elif re.fullmatch(_KEY, part):
            requirements.append(Requirement(part, "exists"))
        else:
            raise errors.bad_request(f"unable to parse requirement: {part!r}")
    return requirements


#: Field selectors beyond metadata.name/namespace, per group/plural.
EXTRA_FIELDS: dict[tuple[str, str], frozenset[str]] = {
    ("", "events"): frozenset(
        {
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        }
    ),
    ("", "pods"): frozenset(
        {"spec.nodeName", "spec.restartPolicy", "status.phase", "status.podIP"}
    ),
    ("", "secrets"): frozenset({"type"}),
    ("", "namespaces"): frozenset({"status.phase"}),
    ("apps", "replicasets"): frozenset({"status.replicas"}),
}


def parse_field_selector(text: str, group: str, plural: str) -> list[tuple[str, str, str]]:
    allowed = {"metadata.name", "metadata.namespace"} | EXTRA_FIELDS.get((group, plural), set())
    result: list[tuple[str, str, str]] = []
    for part in _split_top_level(text or ""):
        match = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)", part)
        if match is None:
            raise errors.bad_request(f"invalid selector: {text!r}; can't understand {part!r}")
        field, operator, value = match.groups()
        if field not in allowed:
            raise errors.bad_request(f"field label not supported: {field}")
        result.append((field, "!=" if operator == "!=" else "=", value))
    return result


Predicate = Callable[[Mapping[str, Any]], bool]


def matcher(label_selector: str, field_selector: str, group: str, plural: str) -> Predicate:
    labels = parse_label_selector(label_selector)
    fields = parse_field_selector(field_selector, group, plural)

    def matches(obj: Mapping[str, Any]) -> bool:
        object_labels = objects.metadata(obj).get("labels") or {}
        if not all(req.matches(object_labels) for req in labels):
            return False
        for field, operator, value in fields:
            actual = objects.get_path(obj, field)
            actual_text = "" if actual is None else str(actual)
            if (actual_text == value) != (operator == "="):
                return False
        return True

    return matches
