"""Tagged JSON: how journal values and step inputs become bytes.

Plain JSON values pass through unchanged. Everything else is a one-key-plus-value object
``{"$t": <tag>, "v": <payload>}``; a user dict that itself has a ``"$t"`` key is escaped the
same way, so decoding is unambiguous. Supported beyond JSON: tuples, sets, bytes, non-finite
floats, dicts with non-string keys, ``datetime``/``date``/``time``/``timedelta``, ``Decimal``,
``UUID``, enums, dataclasses and pydantic models.

Decoding never imports a module or evaluates stored text. Classes (models, dataclasses, enums)
are found in :func:`register_type`'s registry or, failing that, in a module that this process
has *already* imported; an unknown tag or class raises :class:`UnknownTagError`, which the
runtime treats as a corrupt entry.

``CODEC_VERSION`` is stored beside every value; bump it when an encoding changes and keep the
decoder for every older version.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import enum
import json
import math
import sys
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

__all__ = [
    "CODEC_VERSION",
    "UnknownTagError",
    "UnsupportedValueError",
    "canonical_bytes",
    "decode",
    "dumps",
    "encode",
    "loads",
    "register_type",
]

CODEC_VERSION = 1
TAG = "$t"

_registry: dict[str, type] = {}


class UnsupportedValueError(TypeError):
    """A value has no tagged-JSON encoding."""

    def __init__(self, value: object) -> None:
        self.type_name = type(value).__qualname__
        super().__init__(f"cannot encode a value of type {self.type_name!r}")


class UnknownTagError(ValueError):
    """Stored data uses a tag or class this process does not know."""


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def register_type(cls: type) -> type:
    """Allow ``cls`` (a pydantic model, dataclass or enum) to be rebuilt when decoding.

    Usable as a class decorator. Classes already imported in the process are found without
    registration; registering them makes the lookup independent of import order.
    """
    if not (_is_model_class(cls) or dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
        raise TypeError(f"{cls!r} is not a pydantic model, dataclass or enum")
    _registry[_class_name(cls)] = cls
    return cls


def _is_model_class(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, BaseModel)


def _lookup(name: str) -> type:
    cls = _registry.get(name)
    if cls is not None:
        return cls
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)  # never import: only what the process already loaded
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UnknownTagError(f"class {name!r} is not registered nor imported")
    if isinstance(obj, type) and (
        _is_model_class(obj) or dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
    ):
        return obj
    raise UnknownTagError(f"{name!r} is not a model, dataclass or enum")


def _tagged(tag: str, payload: Any) -> dict[str, Any]:
    return {TAG: tag, "v": payload}


def _sort_key(item: Any) -> str:
    return json.dumps(item, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def encode(value: Any) -> Any:
    """Turn ``value`` into plain JSON data (dicts, lists, str, int, float, bool, None)."""
    # Exact-type checks first: they are the hot path for step arguments and results.
    t = type(value)
    if value is None or t is str or t is bool or t is int:
        return value
    if t is float:
        if math.isfinite(value):
            return value
        return _tagged("float", "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
    if t is list:
        return [encode(v) for v in value]
    if t is dict:
        if TAG not in value and all(type(k) is str for k in value):
            return {k: encode(v) for k, v in value.items()}
        pairs = [[encode(k), encode(v)] for k, v in value.items()]
        pairs.sort(key=lambda p: _sort_key(p[0]))
        return _tagged("dict", pairs)
    if t is tuple:
        return _tagged("tuple", [encode(v) for v in value])
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler(value)
    raise UnsupportedValueError(value)


def _encode_set(value: set[Any] | frozenset[Any]) -> Any:
    items = sorted((encode(v) for v in value), key=_sort_key)
    return _tagged("frozenset" if isinstance(value, frozenset) else "set", items)


def _encode_model(value: BaseModel) -> Any:
    fields = {k: encode(getattr(value, k)) for k in type(value).model_fields}
    return _tagged("model", {"cls": _class_name(type(value)), "fields": fields})


def _encode_dataclass(value: Any) -> Any:
    fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return _tagged("dataclass", {"cls": _class_name(type(value)), "fields": fields})


def _encode_enum(value: enum.Enum) -> Any:
    return _tagged("enum", {"cls": _class_name(type(value)), "value": encode(value.value)})


def _encode_datetime(value: dt.datetime) -> Any:
    return _tagged("datetime", value.isoformat())


def _encode_any_dataclass(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_dataclass(value)
    raise UnsupportedValueError(value)


_HANDLERS: list[tuple[type | tuple[type, ...], Callable[[Any], Any]]] = [
    (bool, lambda v: bool(v)),
    (enum.Enum, _encode_enum),  # before int/str: IntEnum and StrEnum are enums first
    (str, lambda v: str(v)),
    (int, lambda v: int(v)),
    (float, lambda v: encode(float(v))),
    ((bytes, bytearray, memoryview), lambda v: _tagged("bytes", base64.b64encode(v).decode())),
    ((set, frozenset), _encode_set),
    (list, lambda v: [encode(x) for x in v]),
    (tuple, lambda v: _tagged("tuple", [encode(x) for x in v])),
    (dict, lambda v: encode(dict(v))),
    (BaseModel, _encode_model),
    (dt.datetime, _encode_datetime),  # before date: datetime is a date subclass
    (dt.date, lambda v: _tagged("date", v.isoformat())),
    (dt.time, lambda v: _tagged("time", v.isoformat())),
    (dt.timedelta, lambda v: _tagged("timedelta", [v.days, v.seconds, v.microseconds])),
    (decimal.Decimal, lambda v: _tagged("decimal", str(v))),
    (uuid.UUID, lambda v: _tagged("uuid", str(v))),
    (object, _encode_any_dataclass),
]


def decode(data: Any) -> Any:
    """Inverse of :func:`encode`. Raises :class:`UnknownTagError` on unknown tags or classes."""
    t = type(data)
    if t is list:
        return [decode(v) for v in data]
    if t is dict:
        if TAG not in data:
            return {k: decode(v) for k, v in data.items()}
        return _decode_tagged(data)
    return data


def _decode_tagged(data: dict[str, Any]) -> Any:
    tag = data[TAG]
    payload = data.get("v")
    decoder = _DECODERS.get(tag) if isinstance(tag, str) else None
    if decoder is None:
        raise UnknownTagError(f"unknown tag {tag!r}")
    try:
        return decoder(payload)
    except UnknownTagError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, decimal.InvalidOperation) as exc:
        raise UnknownTagError(f"malformed {tag!r} value: {exc}") from exc


def _decode_model(payload: dict[str, Any]) -> Any:
    cls = _lookup(payload["cls"])
    fields = {k: decode(v) for k, v in payload["fields"].items()}
    if _is_model_class(cls):
        return cls.model_validate(fields)  # type: ignore[attr-defined]
    return cls(**fields)


def _decode_enum(payload: dict[str, Any]) -> Any:
    cls = _lookup(payload["cls"])
    return cls(decode(payload["value"]))


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "float": lambda p: {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[p],
    "tuple": lambda p: tuple(decode(v) for v in p),
    "set": lambda p: {decode(v) for v in p},
    "frozenset": lambda p: frozenset(decode(v) for v in p),
    "dict": lambda p: {decode(k): decode(v) for k, v in p},
    "bytes": lambda p: base64.b64decode(p, validate=True),
    "model": _decode_model,
    "dataclass": _decode_model,
    "enum": _decode_enum,
    "datetime": dt.datetime.fromisoformat,
    "date": dt.date.fromisoformat,
    "time": dt.time.fromisoformat,
    "timedelta": lambda p: dt.timedelta(days=p[0], seconds=p[1], microseconds=p[2]),
    "decimal": decimal.Decimal,
    "uuid": uuid.UUID,
}


def dumps(value: Any) -> bytes:
    """Encode ``value`` to compact UTF-8 JSON bytes (the stored form)."""
    return json.dumps(
        encode(value), separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def loads(raw: bytes | str) -> Any:
    """Decode bytes written by :func:`dumps`."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UnknownTagError(f"not valid JSON: {exc}") from exc
    return decode(data)


def canonical_bytes(value: Any) -> bytes:
    """The canonical encoding used for fingerprints: sorted keys, no whitespace, UTF-8."""
    return json.dumps(
        encode(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()
