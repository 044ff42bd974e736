"""The control channel's wire format: what the ranks of a replica send one another (step
plans, sampled tokens, start-up facts) as JSON, read back strictly as the type the receiver
expects.

Nothing a peer sends is ever run: pickle (what torch.distributed's ``*_object`` calls use)
builds whatever objects the bytes name, so a peer that reaches the rendezvous port could run
code on every rank. Here a message is UTF-8 JSON, checked against the expected type field by
field: dataclasses and pydantic models by their annotations (every field present, none
unknown; a model's own validators run too), lists, tuples, dicts, Literals, None, bool, int,
float and str. JSON object keys are strings, so int keys (a logprob's token ids) are written
as decimal strings and read back as ints. Floats come back exactly (JSON keeps Python's
shortest round-trip repr; ±inf and NaN as ``Infinity``/``NaN``).

Anything else — not JSON, a key named twice, a missing, unknown or mistyped field, a value a
model refuses, more than ``MAX_MESSAGE_BYTES`` — is a ``WireError`` that names the field.
The checks are built once per type and a message is read in one pass: plans are decoded
every step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import types
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import torch
from pydantic import BaseModel, ValidationError

#: Largest message a rank accepts (a step plan of a full batch is a few MiB).
MAX_MESSAGE_BYTES = 256 * 2**20

_INT_KEY = re.compile(r"0|-?[1-9][0-9]{0,18}")
_SCALARS = (bool, int, float, str)

#: Checks one parsed JSON value and returns it as its type (``WireError`` if it is not).
Decoder = Callable[[Any], Any]


class WireError(ValueError):
    """A message that is not the type the receiving rank expects."""

    def __init__(self, problem: str, path: str = "") -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.problem = problem
        self.path = path

    def at(self, step: str) -> WireError:
        """The same problem, one level further out (``step``: ``.field`` or ``[index]``)."""
        return WireError(self.problem, step + self.path)


def encode(value: Any) -> bytes:
    """``value`` as a JSON message; ``TypeError`` names a part that has no plain form."""
    return json.dumps(value, default=_fields_of, separators=(",", ":")).encode("ascii")


def decode(data: bytes, kind: Any, what: str = "message") -> Any:
    """The ``kind`` (a class, or a type such as ``list[int] | None``) that ``data`` holds;
    ``what`` names the message in errors."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"{len(data)} bytes, more than {MAX_MESSAGE_BYTES}", what)
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise WireError(f"not a JSON message ({_short(str(exc))})", what) from None
    try:
        return _decoder(kind)(value)
    except WireError as exc:
        where = f"{what}: {exc.path.removeprefix('.')}" if exc.path else what
        raise WireError(exc.problem, where) from None


def to_tensors(value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A message as the two tensors that carry it: its length ([1] int64), its bytes."""
    data = encode(value)
    return size_tensor(len(data)), torch.frombuffer(bytearray(data), dtype=torch.uint8)


def size_tensor(length: int = 0) -> torch.Tensor:
    return torch.tensor([length], dtype=torch.long)


def buffer(size: torch.Tensor, what: str) -> torch.Tensor:
    """Room for a message of the length ``size`` announced (checked first)."""
    length = int(size.item())
    if not 0 < length <= MAX_MESSAGE_BYTES:
        raise WireError(f"announces {length} bytes (at most {MAX_MESSAGE_BYTES})", what)
    return torch.empty(length, dtype=torch.uint8)


def decode_tensor(payload: torch.Tensor, kind: Any, what: str) -> Any:
    return decode(payload.numpy().tobytes(), kind, what)


def _fields_of(value: Any) -> dict[str, Any]:
    """A dataclass or a pydantic model as the object of its fields (the rest is JSON's own:
    lists, tuples, dicts with str or int keys, str, int, float, bool, None)."""
    if isinstance(value, BaseModel):
        return {name: getattr(value, name) for name in type(value).model_fields}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    raise TypeError(f"a {type(value).__name__} cannot go over the control channel")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("an object names a key twice")
    return out


@functools.cache
def _decoder(kind: Any) -> Decoder:
    origin, args = get_origin(kind), get_args(kind)
    if origin is Annotated:
        return _decoder(args[0])
    if kind is None or kind is type(None):
        return _null
    if origin is Union or origin is types.UnionType:
        return _union_decoder(args)
    if origin is Literal:
        return _literal_decoder(args)
    if kind in _SCALARS:
        return functools.partial(_scalar, kind=kind)
    if origin is list:
        return _list_decoder(args[0])
    if origin is tuple:
        return _tuple_decoder(args)
    if origin is dict:
        return _dict_decoder(*args)
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return _model_decoder(kind)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        hints = get_type_hints(kind)
        fields = {f.name: hints[f.name] for f in dataclasses.fields(kind) if f.init}
        return _object_decoder(kind.__name__, fields, lambda data: kind(**data))
    raise TypeError(f"{kind!r} has no wire form")  # a bug, not a bad message


def _null(value: Any) -> None:
    if value is not None:
        raise _mismatch("null", value)


def _scalar(value: Any, kind: type) -> Any:
    if type(value) is kind:
        return value
    if kind is float and type(value) is int:
        return float(value)
    raise _mismatch(kind.__name__, value)


def _union_decoder(args: tuple[Any, ...]) -> Decoder:
    nullable = type(None) in args
    options = [_decoder(a) for a in args if a is not type(None)]
    names = " | ".join(getattr(a, "__name__", str(a)) for a in args)

    def union(value: Any) -> Any:
        if value is None and nullable:
            return None
        errors: list[WireError] = []
        for option in options:
            try:
                return option(value)
            except WireError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise _mismatch(names, value)

    return union


def _literal_decoder(args: tuple[Any, ...]) -> Decoder:
    def literal(value: Any) -> Any:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise _mismatch(f"one of {list(args)}", value)

    return literal


def _list_decoder(item_kind: Any) -> Decoder:
    item = _decoder(item_kind)
    scalar = item_kind in _SCALARS

    def items(value: Any) -> Any:
        _expect(value, list, "a list")
        if scalar and set(map(type, value)) <= {item_kind}:
            return value  # a fresh list of the right scalars (token ids, block tables)
        return [_at(item, v, i) for i, v in enumerate(value)]

    return items


def _tuple_decoder(args: tuple[Any, ...]) -> Decoder:
    if len(args) == 2 and args[1] is Ellipsis:
        items = _list_decoder(args[0])
        return lambda value: tuple(items(value))
    decoders = [_decoder(a) for a in args]

    def fixed(value: Any) -> tuple[Any, ...]:
        _expect(value, list, "a list")
        if len(value) != len(decoders):
            raise WireError(f"expected {len(decoders)} items, got {len(value)}")
        pairs = zip(decoders, value, strict=True)
        return tuple(_at(item, v, i) for i, (item, v) in enumerate(pairs))

    return fixed


def _dict_decoder(key_kind: Any, value_kind: Any) -> Decoder:
    if key_kind not in (str, int):
        raise TypeError(f"{key_kind!r} keys have no wire form")  # a bug, not a bad message
    item = _decoder(value_kind)

    def mapping(value: Any) -> dict[Any, Any]:
        _expect(value, dict, "an object")
        out = {}
        for key, v in value.items():
            if key_kind is int and not _INT_KEY.fullmatch(key):
                raise WireError(f"key {_short(repr(key))} is not an int")
            out[int(key) if key_kind is int else key] = _at(item, v, key)
        return out

    return mapping


def _model_decoder(model: type[BaseModel]) -> Decoder:
    fields = {name: f.annotation for name, f in model.model_fields.items()}
    read_fields = _object_decoder(model.__name__, fields, lambda data: data)

    def validated(value: Any) -> Any:
        try:
            return model.model_validate(read_fields(value), strict=True, by_name=True)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or '-'}: {e['msg']}" for e in exc.errors()
            )
            raise WireError(_short(problems, 300)) from None

    return validated


def _object_decoder(
    name: str, fields: dict[str, Any], build: Callable[[dict[str, Any]], Any]
) -> Decoder:
    decoders = {field: _decoder(kind) for field, kind in fields.items()}
    names = set(fields)

    def read(value: Any) -> Any:
        _expect(value, dict, f"a {name} object")
        if value.keys() != names:
            unknown = sorted(value.keys() - names)
            if unknown:
                raise WireError(f"{name} has no field {_short(', '.join(unknown))}")
            missing = [field for field in fields if field not in value]
            raise WireError(f"{name} misses {', '.join(missing)}")
        out = {}
        for field, decode in decoders.items():
            try:
                out[field] = decode(value[field])
            except WireError as exc:
                raise exc.at(f".{field}") from None
        return build(out)

    return read


def _at(decode: Decoder, value: Any, index: int | str) -> Any:
    try:
        return decode(value)
    except WireError as exc:
        raise exc.at(f"[{_short(str(index))}]") from None


def _expect(value: Any, json_type: type, expected: str) -> None:
    if type(value) is not json_type:
        raise _mismatch(expected, value)


def _mismatch(expected: str, value: Any) -> WireError:
    return WireError(f"expected {expected}, got {_short(repr(value))}")


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[: limit - 1]}…"
