"""``meta.k8s.io/v1`` Tables, what kubectl asks for (``Accept: application/json;as=Table;
v=v1;g=meta.k8s.io``) to print ``kubectl get``.

Custom resources get their CRD version's ``additionalPrinterColumns`` (after Name), with
``type: date`` cells rendered as ages the way the real server renders them; a CRD without
columns gets Age. A few built-ins get their real columns (:data:`BUILTIN_COLUMNS`); others
get Name and Age. JSONPath: simple paths (``.status.readyReplicas``), ``[N]`` indexes and
``[?(@.key=="value")]`` filters -- not the whole JSONPath language.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Mapping
from typing import Any

from . import objects
from .resources import GroupResource, PrinterColumn, ResourceSpec

JsonObject = dict[str, Any]
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]|\[\?\(@\.([^=!]+?)\s*==\s*[\"']?([^\"')]*)[\"']?\)\]")


def jsonpath(obj: Any, path: str) -> Any:
    """Evaluate a simple JSONPath; None when anything on the way is missing."""
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    text = text.lstrip("$")
    if not text.startswith((".", "[")):
        text = "." + text
    current: Any = obj
    position = 0
    while position < len(text):
        match = _STEP.match(text, position)
        if match is None:
            return None
        position = match.end()
        key, index, filter_key, filter_value = match.groups()
        if key is not None:
            if not isinstance(current, Mapping):
                return None
            current = current.get(key)
        elif index is not None:
            if not isinstance(current, list) or int(index) >= len(current):
                return None
            current = current[int(index)]
        else:
            if not isinstance(current, list):
                return None
            found = [
                item
                for item in current
                if isinstance(item, Mapping)
                and str(objects.get_path(item, filter_key.strip())) == filter_value
            ]
            if not found:
                return None
            current = found[0]
        if current is None:
            return None
    return current


def human_duration(delta: datetime.timedelta) -> str:
    """``k8s.io/apimachinery/pkg/util/duration.HumanDuration``."""
    seconds = int(delta.total_seconds())
    if seconds < -1:
        return "<invalid>"
    if seconds < 0:
        return "0s"
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        rest = seconds % 60
        return f"{minutes}m" if rest == 0 else f"{minutes}m{rest}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = seconds // 3600
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h" if rest == 0 else f"{hours}h{rest}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        rest = hours % 24
        return f"{hours // 24}d" if rest == 0 else f"{hours // 24}d{rest}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def age(value: Any) -> str:
    if not isinstance(value, str):
        return "<unknown>"
    moment = objects.parse_timestamp(value)
    if moment is None:
        return "<unknown>"
    return human_duration(objects.now() - moment)


def _cell(column: PrinterColumn, obj: JsonObject) -> Any:
    value = jsonpath(obj, column.json_path)
    if value is None:
        return None
    if column.type == "date":
        return age(value)
    if isinstance(value, (dict, list)):
        import json

        return json.dumps(value, separators=(",", ":"))
    return value


_NAME = PrinterColumn(
    "Name",
    "string",
    ".metadata.name",
    format="name",
    description="Name must be unique within a namespace.",
)
_AGE = PrinterColumn(
    "Age",
    "date",
    ".metadata.creationTimestamp",
    description="CreationTimestamp is a timestamp representing the server time when this object "
    "was created.",
)

Cells = Callable[[JsonObject], list[Any]]


def _deployment(obj: JsonObject) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    ready = f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 0)}"
    return [ready, status.get("updatedReplicas", 0), status.get("availableReplicas", 0)]


def _service(obj: JsonObject) -> list[Any]:
    spec = obj.get("spec") or {}
    ports = ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or ())
    external = ",".join(spec.get("externalIPs") or ()) or "<none>"
    return [
        spec.get("type", "ClusterIP"),
        spec.get("clusterIP", "<none>"),
        external,
        ports or "<none>",
    ]


def _pod(obj: JsonObject) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    containers = spec.get("containers") or ()
    statuses = status.get("containerStatuses") or ()
    ready = sum(1 for s in statuses if s.get("ready"))
    restarts = sum(int(s.get("restartCount", 0)) for s in statuses)
    return [f"{ready}/{len(containers)}", status.get("phase", "Pending"), restarts]


def _col(name: str, type_: str = "string") -> PrinterColumn:
    return PrinterColumn(name, type_, "")


#: (group, plural) → (columns between Name and Age, the function computing their cells).
BUILTIN_COLUMNS: dict[GroupResource, tuple[tuple[PrinterColumn, ...], Cells]] = {
    ("apps", "deployments"): (
        (_col("Ready"), _col("Up-to-date", "integer"), _col("Available", "integer")),
        _deployment,
    ),
    ("", "namespaces"): ((_col("Status"),), lambda o: [(o.get("status") or {}).get("phase")]),
    ("", "configmaps"): ((_col("Data", "integer"),), lambda o: [len(o.get("data") or {})]),
    ("", "secrets"): (
        (_col("Type"), _col("Data", "integer")),
        lambda o: [o.get("type", "Opaque"), len(o.get("data") or {})],
    ),
    ("", "services"): (
        (_col("Type"), _col("Cluster-IP"), _col("External-IP"), _col("Port(s)")),
        _service,
    ),
    ("", "pods"): ((_col("Ready"), _col("Status"), _col("Restarts", "integer")), _pod),
}


def columns_and_cells(
    spec: ResourceSpec,
) -> tuple[list[PrinterColumn], Callable[[JsonObject], list[Any]]]:
    if spec.is_custom:
        custom = list(spec.printer_columns)
        if not custom:
            custom = [_AGE]
        return [_NAME, *custom], lambda o: [o["metadata"]["name"], *(_cell(c, o) for c in custom)]
    extra, cells = BUILTIN_COLUMNS.get(spec.group_resource, ((), lambda o: []))
    columns = [_NAME, *extra, _AGE]
    return columns, lambda o: [
        o["metadata"]["name"],
        *cells(o),
        age(o["metadata"].get("creationTimestamp")),
    ]


def _row_object(obj: JsonObject, include: str) -> JsonObject | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj.get("metadata", {}),
    }


def table(
    spec: ResourceSpec,
    items: list[JsonObject],
    *,
    resource_version: str,
    include_object: str = "Metadata",
    continue_token: str = "",
) -> JsonObject:
    columns, cells = columns_and_cells(spec)
    rows: list[JsonObject] = []
    for obj in items:
        row: JsonObject = {"cells": cells(obj)}
        partial = _row_object(obj, include_object)
        if partial is not None:
            row["object"] = partial
        rows.append(row)
    metadata: JsonObject = {"resourceVersion": resource_version}
    if continue_token:
        metadata["continue"] = continue_token
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": [
            {
                "name": c.name,
                "type": c.type,
                "format": c.format,
                "description": c.description,
                "priority": c.priority,
            }
            for c in columns
        ],
        "rows": rows,
    }


def wants_table(accept: str) -> bool:
    """Whether the Accept header's first acceptable type is a meta.k8s.io/v1 Table."""
    for media in accept.split(","):
        params = dict(part.strip().split("=", 1) for part in media.split(";")[1:] if "=" in part)
        if params.get("as") == "Table":
            if params.get("g") == "meta.k8s.io" and params.get("v") in ("v1", "v1beta1"):
                return True
            continue
        if media.split(";")[0].strip() in ("application/json", "*/*", ""):
            return False
    return False
