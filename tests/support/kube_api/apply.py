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

* Lists a custom resource's schema marks ``x-kubernetes-list-type: map`` (with
  ``x-kubernetes-list-map-keys``, e.g. ``status.conditions`` keyed by ``type``) merge item
  by item, and each item's fields are owned by whoever applied them (``k:{"type":"Ready"}``
  in FieldsV1): two managers applying different conditions both keep theirs, and a manager
  that stops applying an item removes only that item.

What is approximated: every other list is atomic (owned and replaced as a whole: the real
server also merges the built-in types' list maps and sets item by item, e.g. containers by
name, and ``listType=set`` lists of custom resources); ``null`` in an applied configuration
means "not applied"; fields only ever change owner as a whole leaf (no ``.`` ownership of
maps); managedFields sent by clients are ignored.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import errors, objects

FieldPath = tuple[str, ...]
#: Lists merged item by item: their path (map keys only, see :func:`schema_path`) → the
#: item fields that identify an item (``x-kubernetes-list-map-keys``).
ListMaps = Mapping[FieldPath, tuple[str, ...]]
NO_LIST_MAPS: ListMaps = {}

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


def schema_path(path: FieldPath) -> FieldPath:
    """A field path without its list-item elements: where its schema is."""
    return tuple(p for p in path if not p.startswith("k:"))


def item_element(item: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    """The path element of a list-map item, as FieldsV1 writes it: ``k:{"type":"Ready"}``."""
    return "k:" + json.dumps({k: item.get(k) for k in keys}, sort_keys=True, separators=(",", ":"))


def _item_keys(element: str) -> dict[str, Any]:
    keys: dict[str, Any] = json.loads(element[2:])
    return keys


def _is_list_map(value: Any, prefix: FieldPath, list_maps: ListMaps) -> bool:
    return (
        isinstance(value, list)
        and schema_path(prefix) in list_maps
        and all(isinstance(item, Mapping) for item in value)
    )


def _leaves(
    value: Any, prefix: FieldPath, list_maps: ListMaps = NO_LIST_MAPS
) -> Iterator[tuple[FieldPath, Any]]:
    if isinstance(value, Mapping) and value:
        for key, nested in value.items():
            yield from _leaves(nested, (*prefix, str(key)), list_maps)
    elif _is_list_map(value, prefix, list_maps):
        keys = list_maps[schema_path(prefix)]
        for item in value:  # an empty list map claims nothing
            yield from _leaves(item, (*prefix, item_element(item, keys)), list_maps)
    else:
        yield prefix, value


def leaf_values(
    obj: Mapping[str, Any],
    status_part: bool | None = None,
    list_maps: ListMaps = NO_LIST_MAPS,
) -> dict[FieldPath, Any]:
    """The owned leaves of an object: maps and list maps are descended, other lists and
    scalars are leaves."""
    result: dict[FieldPath, Any] = {}
    for key, value in obj.items():
        if key in ("apiVersion", "kind") or value is None:
            continue
        if key == "metadata" and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k not in _SERVER_METADATA}
            if not value:
                continue
        for path, leaf in _leaves(value, (key,), list_maps):
            if leaf is not None and in_scope(path, status_part):
                result[path] = leaf
    return result


def fields_v1(paths: set[FieldPath]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for part in path:
            if part.startswith("k:"):
                node = node.setdefault(part, {".": {}})
            else:
                node = node.setdefault(f"f:{part}", {})
    return tree


def _overlaps(a: FieldPath, b: FieldPath) -> bool:
    shorter = min(len(a), len(b))
    return a[:shorter] == b[:shorter]


def _find_item(items: list[Any], element: str) -> int | None:
    keys = _item_keys(element)
    for index, item in enumerate(items):
        if isinstance(item, Mapping) and all(item.get(k) == v for k, v in keys.items()):
            return index
    return None


def _step(current: Any, part: str) -> Any:
    """The child ``part`` of a map, or the item ``part`` (``k:{...}``) of a list map."""
    if isinstance(current, list) and part.startswith("k:"):
        index = _find_item(current, part)
        return _MISSING if index is None else current[index]
    if isinstance(current, Mapping) and part in current:
        return current[part]
    return _MISSING


def _value_at(obj: Mapping[str, Any], path: FieldPath) -> Any:
    current: Any = obj
    for part in path:
        current = _step(current, part)
        if current is _MISSING:
            return _MISSING
    return current


def _remove(container: Any, part: str) -> None:
    if isinstance(container, list):
        index = _find_item(container, part)
        if index is not None:
            del container[index]
    elif isinstance(container, dict):
        container.pop(part, None)


def _emptied(node: Any, prefix: FieldPath, keep: set[FieldPath]) -> bool:
    """Whether ``node`` (at ``prefix``) is left with nothing anyone owns: an empty map or
    list, or a list-map item in which nobody owns more than the key fields (what is left
    in it, defaults say, goes with it: the real server removes an item with its owner)."""
    if prefix[-1].startswith("k:") and isinstance(node, Mapping):
        keys = _item_keys(prefix[-1])
        owned = [k for k in keep if len(k) > len(prefix) and k[: len(prefix)] == prefix]
        return all(k[len(prefix)] in keys for k in owned)
    return not node and not any(_overlaps(prefix, k) for k in keep)


def _delete_at(obj: dict[str, Any], path: FieldPath, keep: set[FieldPath]) -> None:
    """Delete a leaf, then the maps, list-map items and lists it leaves empty (unless some
    kept path needs them). An item's key fields go with the item, never alone."""
    chain: list[Any] = [obj]
    for part in path[:-1]:
        nested = _step(chain[-1], part)
        if not isinstance(nested, (dict, list)):
            return
        chain.append(nested)
    if len(path) > 1 and path[-2].startswith("k:") and path[-1] in _item_keys(path[-2]):
        pass  # a key field: removed with its item below, once nothing else is left in it
    else:
        _remove(chain[-1], path[-1])
    for depth in range(len(path) - 1, 0, -1):
        if depth == 1 or not _emptied(chain[depth], path[:depth], keep):
            break
        _remove(chain[depth - 1], path[depth - 1])


def _deep_merge(
    target: dict[str, Any],
    applied: Mapping[str, Any],
    list_maps: ListMaps = NO_LIST_MAPS,
    prefix: FieldPath = (),
) -> None:
    for key, value in applied.items():
        if value is None:
            continue
        path = (*prefix, key)
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _deep_merge(target[key], value, list_maps, path)
        elif _is_list_map(value, path, list_maps) and _is_list_map(
            target.get(key), path, list_maps
        ):
            _merge_items(target[key], value, list_maps, path)
        else:
            target[key] = copy.deepcopy(value)


def _merge_items(
    target: list[Any], applied: list[Any], list_maps: ListMaps, path: FieldPath
) -> None:
    """Merge applied list-map items into ``target`` by their keys (new ones at the end)."""
    keys = list_maps[schema_path(path)]
    for item in applied:
        element = item_element(item, keys)
        index = _find_item(target, element)
        if index is None:
            target.append(copy.deepcopy(dict(item)))
        else:
            _deep_merge(target[index], item, list_maps, (*path, element))


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
    list_maps: ListMaps = NO_LIST_MAPS,
) -> list[ManagerEntry]:
    """Record a non-apply write: the changed leaves move to the writer's Update entry."""
    before = leaf_values(old, status_part, list_maps)
    after = leaf_values(new, status_part, list_maps)
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
    list_maps: ListMaps = NO_LIST_MAPS,
) -> tuple[dict[str, Any], list[ManagerEntry]]:
    """Merge an applied configuration into ``current``; raise 409 on conflicts."""
    config = strip_nulls(applied)
    wanted = leaf_values(config, status_part, list_maps)
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
    _deep_merge(result, scoped, list_maps)
    if applier.fields != new_set:
        applier.time = objects.timestamp()
    applier.fields = new_set
    return result, [e for e in entries if e.fields]


def _dotted(path: FieldPath) -> str:
    """As the real server names a field: ``.status.conditions[type="Ready"].status``."""
    out = ""
    for part in path:
        if part.startswith("k:"):
            out += "".join(f"[{k}={json.dumps(v)}]" for k, v in _item_keys(part).items())
        else:
            out += "." + part
    return out


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
