"""Just enough of the Kubernetes protobuf encoding to read what kubectl's imperative
``create`` commands send for a few kinds (``kubectl create namespace|configmap|secret|
serviceaccount``): they use typed clients that POST ``application/vnd.kubernetes.protobuf``
and read JSON answers. Other kinds are refused with 415 (use ``kubectl apply -f``)."""

from __future__ import annotations

import base64
import datetime
from typing import Any

from . import errors

_MAGIC = b"k8s\x00"

# A field: (name, type); a type is "string", "bytes", "int", "bool", "time", or a tuple:
# ("message", schema), ("map", value type), ("repeated", type).
Schema = dict[int, tuple[str, Any]]

_TIME: Schema = {1: ("seconds", "int"), 2: ("nanos", "int")}
_OWNER_REFERENCE: Schema = {
    1: ("kind", "string"),
    3: ("name", "string"),
    4: ("uid", "string"),
    5: ("apiVersion", "string"),
    6: ("controller", "bool"),
    7: ("blockOwnerDeletion", "bool"),
}
_OBJECT_META: Schema = {
    1: ("name", "string"),
    2: ("generateName", "string"),
    3: ("namespace", "string"),
    5: ("uid", "string"),
    6: ("resourceVersion", "string"),
    7: ("generation", "int"),
    8: ("creationTimestamp", "time"),
    11: ("labels", ("map", "string")),
    12: ("annotations", ("map", "string")),
    13: ("ownerReferences", ("repeated", ("message", _OWNER_REFERENCE))),
    14: ("finalizers", ("repeated", "string")),
}
_META = ("metadata", ("message", _OBJECT_META))
KINDS: dict[tuple[str, str], Schema] = {
    ("v1", "Namespace"): {
        1: _META,
        2: ("spec", ("message", {1: ("finalizers", ("repeated", "string"))})),
    },
    ("v1", "ConfigMap"): {
        1: _META,
        2: ("data", ("map", "string")),
        3: ("binaryData", ("map", "bytes")),
        4: ("immutable", "bool"),
    },
    ("v1", "Secret"): {
        1: _META,
        2: ("data", ("map", "bytes")),
        3: ("type", "string"),
        4: ("stringData", ("map", "string")),
        5: ("immutable", "bool"),
    },
    ("v1", "ServiceAccount"): {1: _META, 4: ("automountServiceAccountToken", "bool")},
}


def _varint(data: bytes, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, position


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    fields: list[tuple[int, int | bytes]] = []
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, position = _varint(data, position)
            fields.append((number, value))
        elif wire == 2:
            length, position = _varint(data, position)
            fields.append((number, data[position : position + length]))
            position += length
        elif wire == 1:
            position += 8
        elif wire == 5:
            position += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return fields


def _scalar(kind: str, value: int | bytes) -> Any:
    if kind == "string":
        return value.decode() if isinstance(value, bytes) else str(value)
    if kind == "bytes":
        return base64.b64encode(value if isinstance(value, bytes) else b"").decode()
    if kind == "bool":
        return bool(value)
    if kind == "int":
        return int(value) if isinstance(value, int) else 0
    if kind == "time":
        seconds = _message(_TIME, value if isinstance(value, bytes) else b"").get("seconds", 0)
        moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
        return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
    raise ValueError(kind)


def _value(kind: Any, value: int | bytes) -> Any:
    if isinstance(kind, tuple) and kind[0] == "message":
        return _message(kind[1], value if isinstance(value, bytes) else b"")
    return _scalar(kind, value)


def _message(schema: Schema, data: bytes) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for number, value in _fields(data):
        if number not in schema:
            continue
        name, kind = schema[number]
        if isinstance(kind, tuple) and kind[0] == "map":
            entry = dict(_fields(value if isinstance(value, bytes) else b""))
            key = _scalar("string", entry.get(1, b""))
            result.setdefault(name, {})[key] = _scalar(kind[1], entry.get(2, b""))
        elif isinstance(kind, tuple) and kind[0] == "repeated":
            result.setdefault(name, []).append(_value(kind[1], value))
        else:
            decoded = _value(kind, value)
            if decoded not in ("", 0, False, {}):  # Go's zero values mean "unset"
                result[name] = decoded
    return result


def decode(raw: bytes) -> dict[str, Any]:
    """A protobuf-encoded object (``k8s\\0`` + ``runtime.Unknown``) as a JSON-like dict."""
    if not raw.startswith(_MAGIC):
        raise errors.bad_request("the protobuf body lacks the k8s envelope")
    envelope = dict(_fields(raw[len(_MAGIC) :]))
    raw_type_meta = envelope.get(1, b"")
    type_meta = dict(_fields(raw_type_meta if isinstance(raw_type_meta, bytes) else b""))
    api_version = _scalar("string", type_meta.get(1, b""))
    kind = _scalar("string", type_meta.get(2, b""))
    schema = KINDS.get((api_version, kind))
    if schema is None:
        raise errors.ApiError(
            415,
            "UnsupportedMediaType",
            f"the emulated kube-apiserver reads protobuf only for "
            f"{', '.join(k for _, k in KINDS)}, not {api_version} {kind}; "
            "send JSON (e.g. kubectl apply -f)",
        )
    body = envelope.get(2, b"")
    obj = _message(schema, body if isinstance(body, bytes) else b"")
    return {"apiVersion": api_version, "kind": kind, **obj}
