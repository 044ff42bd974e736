"""Field ownership (``metadata.managedFields``) and server-side apply, APPROXIMATED.

What is emulated:

* Every write records which manager set which fields: ``Apply`` entries for
  ``application/apply-patch+yaml`` patches (manager from the required ``fieldManager``
  query parameter), ``Update`` entries for create/update/patch (``fieldManager`` or the
  User-Agent's product name, e.g. ``kubectl``, ``kopf``, ``OpenAPI-Generator``). Writes to
  ``/status`` record ``subresource: status``. They are rendered as real ``FieldsV1`` sets.
* Apply creates a missing object (201), merges the applied fields into an existing one,
  and removes the fields the same manager applied before but omits now (unless another
  manager also owns them). Re-applying the same configuration changes nothing (the
  resourceVersion stays). Changing a field another manager owns is a 409 Conflict unless
  ``force=true``, which takes the ownership over, as in the real server; an Update takes
  ownership without conflicts.

What is approximated: every list is atomic (owned and replaced as a whole: the real server
merges ``listType=map``/``set`` lists item by item, e.g. containers by name); ``null`` in an
applied configuration means "not applied"; fields only ever change owner as a whole leaf
(no ``.`` ownership of maps); managedFields sent by clients are ignored.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import errors, objects

FieldPath = tuple[str, ...]

#: Metadata fields the server owns or that identify the object: never "managed".
_SERVER_METADATA = frozenset(
    {
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "managedFields",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "selfLink",
    }
)
_MISSING = object()


@dataclass
class ManagerEntry:
    manager: str
    operation: str  # "Apply" or "Update"
    subresource: str  # "" or "status"
    api_version: str
    time: str
    fields: set[FieldPath] = field(default_factory=set)

    def render(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
            "time": self.time,
            "fieldsType": "FieldsV1",
            "fieldsV1": fields_v1(self.fields),
        }
        if self.subresource:
            entry["subresource"] = self.subresource
        return entry


def in_scope(path: FieldPath, status_part: bool | None) -> bool:
    """Whether a path belongs to the part of the object a write may change: everything
    (None), only ``status`` (True, a /status write), or all but ``status`` (False)."""
    if status_part is None:
        return True
    return (path[:1] == ("status",)) == status_part


def _leaves(value: Any, prefix: FieldPath) -> Iterator[tuple[FieldPath, Any]]:
    if isinstance(value, Mapping) and value:
        for key, nested in value.items():
            yield from _leaves(nested, (*prefix, str(key)))
    else:
        yield prefix, value


def leaf_values(obj: Mapping[str, Any], status_part: bool | None = None) -> dict[FieldPath, Any]:
    """The owned leaves of an object: maps are descended, lists and scalars are leaves."""
    result: dict[FieldPath, Any] = {}
    for key, value in obj.items():
        if key in ("apiVersion", "kind") or value is None:
            continue
        if key == "metadata" and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k not in _SERVER_METADATA}
            if not value:
                continue
        for path, leaf in _leaves(value, (key,)):
            if leaf is not None and in_scope(path, status_part):
                result[path] = leaf
    return result


def fields_v1(paths: set[FieldPath]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for part in path:
            node = node.setdefault(f"f:{part}", {})
    return tree


def _overlaps(a: FieldPath, b: FieldPath) -> bool:
    shorter = min(len(a), len(b))
    return a[:shorter] == b[:shorter]


def _value_at(obj: Mapping[str, Any], path: FieldPath) -> Any:
    current: Any = obj
    for part in path:
        if not isinstance(current, Mapping) or part not in current:
            return _MISSING
        current = current[part]
    return current


def _delete_at(obj: dict[str, Any], path: FieldPath, keep: set[FieldPath]) -> None:
    """Delete a leaf, then the maps it leaves empty (unless some kept path needs them)."""
    chain: list[dict[str, Any]] = [obj]
    for part in path[:-1]:
        nested = chain[-1].get(part)
        if not isinstance(nested, dict):
            return
        chain.append(nested)
    chain[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):
        prefix = path[:depth]
        if chain[depth] or any(_overlaps(prefix, k) for k in keep) or depth == 1:
            break
        chain[depth - 1].pop(path[depth - 1], None)


def _deep_merge(target: dict[str, Any], applied: Mapping[str, Any]) -> None:
    for key, value in applied.items():
        if value is None:
            continue
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _deep_merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def strip_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: strip_nulls(v) for k, v in value.items() if v is not None}
    return value


def _entry(
    entries: list[ManagerEntry], manager: str, operation: str, subresource: str, api_version: str
) -> ManagerEntry:
    for entry in entries:
        if (entry.manager, entry.operation, entry.subresource) == (manager, operation, subresource):
            entry.api_version = api_version
            return entry
    entry = ManagerEntry(manager, operation, subresource, api_version, objects.timestamp())
    entries.append(entry)
    return entry


def track_update(
    entries: list[ManagerEntry],
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    manager: str,
    subresource: str,
    api_version: str,
    status_part: bool | None,
) -> list[ManagerEntry]:
    """Record a non-apply write: the changed leaves move to the writer's Update entry."""
    before = leaf_values(old, status_part)
    after = leaf_values(new, status_part)
    changed = {p for p, v in after.items() if before.get(p, _MISSING) != v}
    removed = set(before) - set(after)
    touched = changed | removed
    if not touched:
        return entries
    for entry in entries:
        entry.fields = {q for q in entry.fields if not any(_overlaps(q, p) for p in touched)}
    if changed:
        writer = _entry(entries, manager, "Update", subresource, api_version)
        writer.fields |= changed
        writer.time = objects.timestamp()
    return [e for e in entries if e.fields]


def server_side_apply(
    entries: list[ManagerEntry],
    current: Mapping[str, Any],
    applied: Mapping[str, Any],
    *,
    manager: str,
    force: bool,
    subresource: str,
    api_version: str,
    status_part: bool | None,
    group: str,
    plural: str,
    name: str,
) -> tuple[dict[str, Any], list[ManagerEntry]]:
    """Merge an applied configuration into ``current``; raise 409 on conflicts."""
    config = strip_nulls(applied)
    wanted = leaf_values(config, status_part)
    new_set = set(wanted)
    others = [e for e in entries if e.manager != manager]
    conflicts: list[tuple[str, FieldPath]] = []
    for entry in others:
        for owned in entry.fields:
            for path in new_set:
                if _overlaps(owned, path) and _value_at(current, path) != wanted[path]:
                    conflicts.append((entry.manager, path))
    if conflicts and not force:
        raise _conflict_error(conflicts, api_version, group, plural, name)
    if conflicts:
        stolen = {path for _, path in conflicts}
        for entry in others:
            entry.fields = {q for q in entry.fields if not any(_overlaps(q, p) for p in stolen)}
    applier = _entry(entries, manager, "Apply", subresource, api_version)
    kept = set().union(*(e.fields for e in entries if e is not applier)) | new_set
    result = copy.deepcopy(dict(current))
    for path in sorted(applier.fields - new_set, key=len, reverse=True):
        if not any(_overlaps(path, k) for k in kept):
            _delete_at(result, path, kept)
    scoped = {
        k: v
        for k, v in config.items()
        if k in ("apiVersion", "kind", "metadata") or in_scope((k,), status_part)
    }
    _deep_merge(result, scoped)
    if applier.fields != new_set:
        applier.time = objects.timestamp()
    applier.fields = new_set
    return result, [e for e in entries if e.fields]


def _dotted(path: FieldPath) -> str:
    return "." + ".".join(path)


def _conflict_error(
    conflicts: list[tuple[str, FieldPath]], api_version: str, group: str, plural: str, name: str
) -> errors.ApiError:
    unique = sorted(set(conflicts))
    lines = [
        f'conflict with "{manager}" using {api_version}: {_dotted(p)}' for manager, p in unique
    ]
    count = len(unique)
    noun = "conflict" if count == 1 else "conflicts"
    message = f"Apply failed with {count} {noun}: " + (
        lines[0] if count == 1 else "\n" + "\n".join(f"- {line}" for line in lines)
    )
    error = errors.ApiError(
        409,
        "Conflict",
        message,
        {
            "name": name,
            "group": group,
            "kind": plural,
            "causes": [
                {"reason": "FieldManagerConflict", "message": line, "field": _dotted(p)}
                for line, (_, p) in zip(lines, unique, strict=True)
            ],
        },
    )
    return error


def manager_from_user_agent(user_agent: str) -> str:
    """What the real server names a manager that did not pass ``fieldManager``."""
    product = user_agent.split("/", 1)[0].strip()
    return product or "unknown"
