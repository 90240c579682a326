"""Tagged JSON: how journal values and step inputs become bytes.

Plain JSON values pass through unchanged. Everything else is a one-key-plus-value object
``{"$t": <tag>, "v": <payload>}``; a user dict that itself has a ``"$t"`` key is escaped the
same way, so decoding is unambiguous. Supported beyond JSON: tuples, sets, bytes, non-finite
floats, dicts with non-string keys, ``datetime``/``date``/``time``/``timedelta``, ``Decimal``,
``UUID``, enums, dataclasses and pydantic models.

Stored data is untrusted, so decoding rebuilds a class (model, dataclass or enum) only if it
was registered with :func:`register_type`; loomflow registers its own value types (messages,
usage, tool calls and outcomes, model responses and stream chunks). The class named by a row is
looked up in that registry and nowhere else: decoding never imports a module, never looks a
name up in a loaded module and never runs code of a class that was not registered. A class
that is not registered decodes as plain data (its fields as a ``dict``, an enum as its value).
Values nest at most :data:`MAX_DEPTH` containers deep; deeper (or self-containing) values are
refused by the encoder and stored ones are unreadable. Damaged or malformed data raises
:class:`UnknownTagError`, which the runtime treats as a corrupt entry.

``CODEC_VERSION`` is stored beside every value; bump it when an encoding changes and keep the
decoder for every older version.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import enum
import hashlib
import json
import logging
import math
import operator
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from .._json import valid_value
from .._memo import PerInstance
from ..errors import InvalidArgumentTypeError, _rebuild

__all__ = [
    "CODEC_VERSION",
    "GrowingHasher",
    "GrowingList",
    "MAX_DEPTH",
    "NestingTooDeepError",
    "Printed",
    "UnknownTagError",
    "UnsupportedValueError",
    "canonical_bytes",
    "decode",
    "dumps",
    "encode",
    "is_registered",
    "loads",
    "mark_immutable",
    "plain",
    "printed",
    "register_type",
    "step_fingerprint",
    "valid",
]

CODEC_VERSION = 1
TAG = "$t"

MAX_DEPTH = 100
"""How many containers deep a value may nest (lists, tuples, sets, dicts, models, dataclasses
and enums each count one level).

Real step results stay far below it; the cap keeps a crafted row (or a value that contains
itself) from exhausting Python's recursion limit (1000 frames) while it is encoded or decoded.
"""

log = logging.getLogger("loomflow.runtime.codec")

_registered: set[type] = set()
_registry: dict[str, type] = {}  # by "module:qualname", rebuilt when a name is missed
# Registered models that validate as pydantic does (model_validate not overridden): decoding
# runs their validator directly, one Python frame less per stored model.
_plain_models: set[type] = set()
_plain_warned: set[str] = set()


class UnsupportedValueError(TypeError):
    """A value has no tagged-JSON encoding."""

    def __init__(self, value: object, reason: str | None = None) -> None:
        self.type_name = type(value).__qualname__
        self.reason = reason
        super().__init__(reason or f"cannot encode a value of type {self.type_name!r}")

    def __reduce__(self) -> tuple[object, ...]:  # __init__ takes the value, which is not kept
        return (_rebuild, (type(self), self.args, self.__dict__))


class NestingTooDeepError(UnsupportedValueError):
    """A value nests more than :data:`MAX_DEPTH` containers deep, or contains itself."""

    def __init__(self, value: object) -> None:
        super().__init__(
            value,
            f"holds a value nested more than {MAX_DEPTH} containers deep, or one that "
            "contains itself (the limit is loomflow.runtime.codec.MAX_DEPTH)",
        )


class UnknownTagError(ValueError):
    """Stored data is damaged, malformed, nested too deep or uses a tag this process lacks."""


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def register_type(cls: type) -> type:
    """Allow ``cls`` (a pydantic model, dataclass or enum) to be rebuilt when decoding.

    Usable as a class decorator. Only registered classes come back as instances: decoding
    validates a registered model, calls a registered dataclass (``__post_init__`` included)
    and looks up a registered enum member. Any other class decodes as plain data. Registration
    is process-wide and keyed by ``module:qualname``; register at import time, in the module
    that defines the class, so that every process reading the journal has done it.

    Example:
        >>> @register_type
        ... @dataclasses.dataclass
        ... class Invoice:
        ...     number: str
        ...     total: decimal.Decimal
    """
    if not isinstance(cls, type) or not (
        _is_model_class(cls) or dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)
    ):
        raise InvalidArgumentTypeError(f"{cls!r} is not a pydantic model, dataclass or enum")
    _registered.add(cls)
    _registry[_class_name(cls)] = cls
    if _is_model_class(cls) and _validates_plainly(cls):
        _plain_models.add(cls)
    return cls


def _validates_plainly(cls: type[BaseModel]) -> bool:
    """Whether ``cls.model_validate`` is pydantic's own, which only calls the validator."""
    own: Any = BaseModel.model_validate
    # A staticmethod or plain function there has no __func__: its own way, then.
    return getattr(cls.model_validate, "__func__", None) is own.__func__


def is_registered(cls: type) -> bool:
    """Whether decoding rebuilds ``cls`` (see :func:`register_type`)."""
    return cls in _registered


def _by_name(name: str) -> type | None:
    cls = _registry.get(name)
    if cls is None and name not in _plain_warned:
        # A class may be renamed after registration (a package re-exporting it sets
        # __module__), so index the registered classes under their current names again;
        # once per missed name, so that a row full of unknown names stays cheap.
        _registry.update((_class_name(c), c) for c in _registered)
        cls = _registry.get(name)
    return cls


def _is_model_class(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, BaseModel)


def _lookup(name: Any) -> type | None:
    """The registered class of that name, or ``None``: the registry is the only place asked."""
    if not isinstance(name, str):
        raise UnknownTagError(f"class name {name!r} is not a string")
    cls = _by_name(name)
    if cls is None and name not in _plain_warned and len(_plain_warned) < 1000:
        # Once per name, and a bounded set: crafted rows must not flood the log or the memory.
        _plain_warned.add(name)
        log.warning(
            "journal data names class %r, which is not registered; it decodes as plain data "
            "(register it with loomflow.runtime.register_type to get instances back)",
            name[:200],
        )
    return cls


def _tagged(tag: str, payload: Any) -> dict[str, Any]:
    return {TAG: tag, "v": payload}


def _sort_key(item: Any) -> str:
    return json.dumps(item, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def encode(value: Any) -> Any:
    """Turn ``value`` into plain JSON data (dicts, lists, str, int, float, bool, None).

    Raises :class:`UnsupportedValueError` for a value with no encoding and
    :class:`NestingTooDeepError` for one nested deeper than :data:`MAX_DEPTH` (or cyclic).
    """
    try:
        return _encode(value, 0)
    except RecursionError:  # a caller already deep in its own stack; same answer as the cap
        raise NestingTooDeepError(value) from None


def _encode(value: Any, depth: int) -> Any:
    # Exact-type checks first: they are the hot path for step arguments and results.
    t = type(value)
    if value is None or t is str or t is bool or t is int:
        return value
    if t is float:
        if math.isfinite(value):
            return value
        return _tagged("float", "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
    if t is list:
        inner = _deeper(value, depth)
        return [_encode(v, inner) for v in value]
    if t is dict:
        inner = _deeper(value, depth)
        if TAG not in value and all(type(k) is str for k in value):
            return {k: _encode(v, inner) for k, v in value.items()}
        pairs = [[_encode(k, inner), _encode(v, inner)] for k, v in value.items()]
        pairs.sort(key=lambda p: _sort_key(p[0]))
        return _tagged("dict", pairs)
    if t is tuple:
        inner = _deeper(value, depth)
        return _tagged("tuple", [_encode(v, inner) for v in value])
    if t in _values:
        return _encode_value(value, depth)
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler(value, depth)
    raise UnsupportedValueError(value)


def _deeper(value: Any, depth: int) -> int:
    """The depth of a container's items; a container past the cap is refused."""
    if depth >= MAX_DEPTH:
        raise NestingTooDeepError(value)
    return depth + 1


def _encode_set(value: set[Any] | frozenset[Any], depth: int) -> Any:
    inner = _deeper(value, depth)
    items = sorted((_encode(v, inner) for v in value), key=_sort_key)
    return _tagged("frozenset" if isinstance(value, frozenset) else "set", items)


# Classes whose instances are values: frozen models that nobody changes after building them
# (loomflow's messages, tool calls, usage, responses; see mark_immutable). Their encoding is
# kept per instance, so the transcript a model call journals and fingerprints is walked once
# per message instead of once per turn: with 10 turns, 11 walks of a growing list (O(n^2))
# became one walk per message (see loomflow._memo).
_values: set[type] = set()


# Tagged with the depth they were made at: made at a depth or deeper, they are good at this
# depth too (within MAX_DEPTH).
# Their printed texts are kept the same way, by the printers further down.
_encoded: PerInstance[Any] = PerInstance()  # instance -> its encoding (JSON data)


def mark_immutable(cls: type[BaseModel]) -> type[BaseModel]:
    """Let the encoder keep the encoding of each ``cls`` instance (for loomflow's frozen
    value types: their fields, nested ones included, are never changed after building)."""
    if not _is_model_class(cls) or not cls.model_config.get("frozen"):
        raise InvalidArgumentTypeError(f"{cls!r} is not a frozen pydantic model")
    _values.add(cls)
    return cls


def _encode_value(value: BaseModel, depth: int) -> Any:
    out = _encoded.get(value, depth, at_most=True)
    if out is None:
        out = _encode_model(value, depth)
        _encoded.put(value, depth, out)
    return out


def _encode_model(value: BaseModel, depth: int) -> Any:
    inner = _deeper(value, depth)
    fields = {k: _encode(getattr(value, k), inner) for k in type(value).model_fields}
    return _tagged("model", {"cls": _class_name(type(value)), "fields": fields})


def _encode_dataclass(value: Any, depth: int) -> Any:
    inner = _deeper(value, depth)
    fields = {f.name: _encode(getattr(value, f.name), inner) for f in dataclasses.fields(value)}
    return _tagged("dataclass", {"cls": _class_name(type(value)), "fields": fields})


def _encode_enum(value: enum.Enum, depth: int) -> Any:
    inner = _deeper(value, depth)
    return _tagged("enum", {"cls": _class_name(type(value)), "value": _encode(value.value, inner)})


def _encode_datetime(value: dt.datetime, depth: int) -> Any:
    return _tagged("datetime", value.isoformat())


def _encode_any_dataclass(value: Any, depth: int) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_dataclass(value, depth)
    raise UnsupportedValueError(value)


_HANDLERS: list[tuple[type | tuple[type, ...], Callable[[Any, int], Any]]] = [
    (bool, lambda v, d: bool(v)),
    (enum.Enum, _encode_enum),  # before int/str: IntEnum and StrEnum are enums first
    (str, lambda v, d: str(v)),
    (int, lambda v, d: int(v)),
    (float, lambda v, d: _encode(float(v), d)),
    ((bytes, bytearray, memoryview), lambda v, d: _tagged("bytes", base64.b64encode(v).decode())),
    ((set, frozenset), _encode_set),
    (list, lambda v, d: _encode(list(v), d)),
    (tuple, lambda v, d: _encode(tuple(v), d)),
    (dict, lambda v, d: _encode(dict(v), d)),
    (BaseModel, _encode_model),
    (dt.datetime, _encode_datetime),  # before date: datetime is a date subclass
    (dt.date, lambda v, d: _tagged("date", v.isoformat())),
    (dt.time, lambda v, d: _tagged("time", v.isoformat())),
    (dt.timedelta, lambda v, d: _tagged("timedelta", [v.days, v.seconds, v.microseconds])),
    (decimal.Decimal, lambda v, d: _tagged("decimal", str(v))),
    (uuid.UUID, lambda v, d: _tagged("uuid", str(v))),
    (object, _encode_any_dataclass),
]


def decode(data: Any) -> Any:
    """Inverse of :func:`encode`, for untrusted data.

    Raises :class:`UnknownTagError` (and nothing else) on unknown tags, malformed payloads,
    nesting deeper than :data:`MAX_DEPTH`, or a registered class that refuses the stored fields.
    """
    try:
        return _decode(data, 0)
    except RecursionError:  # a caller already deep in its own stack; same answer as the cap
        raise UnknownTagError(f"nested too deep to decode (more than {MAX_DEPTH})") from None


def _inner(depth: int) -> int:
    if depth >= MAX_DEPTH:
        raise UnknownTagError(f"nested more than {MAX_DEPTH} containers deep")
    return depth + 1


# What JSON parsing gives besides lists and dicts: each decodes as itself, so the walks below
# skip the call for them (most of a stored value's leaves are these).
_LEAVES = frozenset({str, int, float, bool, type(None)})


def _decode(data: Any, depth: int) -> Any:
    t = type(data)
    if t is list:
        inner = _inner(depth)
        return [v if type(v) in _LEAVES else _decode(v, inner) for v in data]
    if t is dict:
        if TAG not in data:
            inner = _inner(depth)
            return {k: v if type(v) in _LEAVES else _decode(v, inner) for k, v in data.items()}
        return _decode_tagged(data, depth)
    return data


def _decode_tagged(data: dict[str, Any], depth: int) -> Any:
    tag = data[TAG]
    payload = data.get("v")
    decoder = _DECODERS.get(tag) if type(tag) is str else None
    if decoder is None:
        raise UnknownTagError(f"unknown tag {str(tag)[:100]!r}")
    try:
        return decoder(payload, depth)
    except UnknownTagError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as exc:
        # ArithmeticError: decimal.InvalidOperation, and the OverflowError of a timedelta
        # whose stored days or seconds are out of range.
        raise UnknownTagError(f"malformed {tag!r} value: {exc}") from exc


def _items(payload: Any) -> list[Any]:
    if type(payload) is not list:
        raise TypeError(f"expected a list, not {type(payload).__name__}")
    return payload


def _fields(payload: Any) -> dict[str, Any]:
    if type(payload) is not dict:
        raise TypeError(f"expected an object, not {type(payload).__name__}")
    return payload


def _decode_container(build: Callable[[Any], Any], *, hashed: bool = False) -> Callable[..., Any]:
    def decoder(payload: Any, depth: int) -> Any:
        inner = _inner(depth)
        items = [_decode(v, inner) for v in _items(payload)]
        if hashed:
            _spread(items)
        return build(items)

    return decoder


_MAX_SAME_HASH = 64
"""How many members of a stored set (or keys of a stored dict) may share one hash."""


def _spread(members: list[Any]) -> None:
    """Refuse members that pile up on one hash before a set or dict is built of them.

    An int's hash is the int itself modulo 2**61 - 1, not randomised as a string's is: a row
    of 40,000 ints 2**61 - 1 apart (1 MB) made building its set take 32 s, quadratic in the
    row's size. What the encoder writes comes from a real set or dict, whose members hardly
    ever share a hash.
    """
    if len(members) <= _MAX_SAME_HASH:
        return
    seen: dict[int, int] = {}
    for member in members:
        h = hash(member)  # an unhashable member: TypeError, a malformed value
        n = seen[h] = seen.get(h, 0) + 1
        if n > _MAX_SAME_HASH:
            raise UnknownTagError(f"more than {_MAX_SAME_HASH} members share one hash (crafted)")


def _decode_dict(payload: Any, depth: int) -> dict[Any, Any]:
    inner = _inner(depth)
    pairs = [_items(pair) for pair in _items(payload)]
    keys: list[Any] = []
    values: list[Any] = []
    for pair in pairs:
        key, value = pair
        keys.append(_decode(key, inner))
        values.append(_decode(value, inner))
    _spread(keys)
    return dict(zip(keys, values, strict=True))


def _decode_model(payload: Any, depth: int) -> Any:
    # _fields and _inner written out: every stored message and response comes through here.
    if type(payload) is not dict:
        raise TypeError(f"expected an object, not {type(payload).__name__}")
    if depth >= MAX_DEPTH:
        raise UnknownTagError(f"nested more than {MAX_DEPTH} containers deep")
    inner = depth + 1
    name = payload["cls"]
    # A registered name is the usual case: one dict look-up; the rest (a name that is not a
    # string, a class renamed since, one not registered) goes the long way.
    cls = _registry.get(name) if type(name) is str else None
    if cls is None:
        cls = _lookup(name)
    stored = payload["fields"]
    if type(stored) is not dict:
        raise TypeError(f"expected an object, not {type(stored).__name__}")
    fields = {k: v if type(v) in _LEAVES else _decode(v, inner) for k, v in stored.items()}
    if cls is None:
        return fields
    try:
        if cls in _plain_models:  # what model_validate(fields) does, without its frame
            return cls.__pydantic_validator__.validate_python(fields)  # type: ignore[attr-defined]
        if _is_model_class(cls):
            return cls.model_validate(fields)  # type: ignore[attr-defined]
        return cls(**fields)
    except Exception as exc:  # registered code ran and refused the stored fields
        raise UnknownTagError(f"{payload['cls']!r} refused the stored fields: {exc}") from exc


def _decode_enum(payload: Any, depth: int) -> Any:
    payload = _fields(payload)
    inner = _inner(depth)
    cls = _lookup(payload["cls"])
    value = _decode(payload["value"], inner)
    if cls is None:
        return value
    try:
        return cls(value)
    except Exception as exc:
        raise UnknownTagError(f"{payload['cls']!r} has no member {value!r}: {exc}") from exc


def _decode_float(payload: Any, depth: int) -> float:
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[payload]


def _decode_bytes(payload: Any, depth: int) -> bytes:
    return base64.b64decode(payload, validate=True)


def _decode_timedelta(payload: Any, depth: int) -> dt.timedelta:
    days, seconds, microseconds = _items(payload)
    return dt.timedelta(days=days, seconds=seconds, microseconds=microseconds)


def _text(parse: Callable[[str], Any]) -> Callable[[Any, int], Any]:
    def decoder(payload: Any, depth: int) -> Any:
        if type(payload) is not str:
            raise TypeError(f"expected a string, not {type(payload).__name__}")
        return parse(payload)

    return decoder


_DECODERS: dict[str, Callable[[Any, int], Any]] = {
    "float": _decode_float,
    "tuple": _decode_container(tuple),
    "set": _decode_container(set, hashed=True),
    "frozenset": _decode_container(frozenset, hashed=True),
    "dict": _decode_dict,
    "bytes": _decode_bytes,
    "model": _decode_model,
    "dataclass": _decode_model,
    "enum": _decode_enum,
    "datetime": _text(dt.datetime.fromisoformat),
    "date": _text(dt.date.fromisoformat),
    "time": _text(dt.time.fromisoformat),
    "timedelta": _decode_timedelta,
    "decimal": _text(decimal.Decimal),
    "uuid": _text(uuid.UUID),
}


# Built once: json.dumps with any non-default option builds a JSONEncoder per call, about
# 2 us of a 5 us encoding of a small step result.
_compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
_canonical_json = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
).encode
_json_string = json.encoder.encode_basestring  # what json.dumps(text, ensure_ascii=False) calls


def _utf8(text: str) -> bytes:
    """The UTF-8 bytes of a printed JSON text.

    A lone surrogate (a ``\\udce9`` escape json.loads read from a tool's input, half an emoji
    from a provider) has no UTF-8 form; it can only sit inside a JSON string, so it is written
    as that JSON escape again, which reads back as the same string.
    """
    try:
        return text.encode()
    except UnicodeEncodeError:
        # A surrogate pair spelled as two code points is the character it stands for (JSON
        # would read its two escapes back as that character anyway); lone ones are escaped.
        joined = text.encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")
        return joined.encode("utf-8", "backslashreplace")


# A model class's printed parts: the module and qualified name they were made for, the head,
# the field keys.
_Layout = tuple[str, str, str, list[tuple[str, str]]]


class _Printer:
    """Prints the JSON text of ``encode(value)`` without building the encoding first.

    Byte for byte what one of the encoders above gives for the whole encoding, but joined from
    the texts of the parts: a list from its items, a plain dict key by key, a pydantic model
    field by field. A value instance (see :func:`mark_immutable`) keeps its text, so a
    transcript that is stored, fingerprinted or checkpointed again and again prints each
    message once; building its tagged encoding only for the JSON encoder to print it cost
    twice as much. What has no direct printing goes to the encoder whole.
    """

    __slots__ = ("_kept", "_layouts", "_sort", "_whole")

    def __init__(self, whole: Callable[[Any], str], *, sort: bool) -> None:
        self._whole = whole  # the encoder this printer matches
        self._sort = sort  # keys in sorted order (the canonical form) or as built
        # Tagged with the depth a text was made at: made at a depth or deeper, it is good at
        # this depth too (within MAX_DEPTH).
        self._kept: PerInstance[str] = PerInstance()
        # Weakly keyed: a model class made per call (pydantic.create_model) may go away.
        self._layouts: weakref.WeakKeyDictionary[type, _Layout] = weakref.WeakKeyDictionary()

    def text(self, value: Any, depth: int) -> str:
        t = type(value)
        if t is str:
            return _json_string(value)
        if t is list or t is GrowingList:
            inner = _deeper(value, depth)
            text = self.text
            return "[" + ",".join([text(v, inner) for v in value]) + "]"
        if t in _values:
            kept = self._kept.get(value, depth, at_most=True)
            if kept is None:
                kept = self._model(value, depth)
                self._kept.put(value, depth, kept)
            return kept
        if t is int:  # a turn or slot number: the text json.dumps gives, without its set-up
            return int.__repr__(value)
        if value is None:
            return "null"
        if t is bool:
            return "true" if value else "false"
        if t is float and math.isfinite(value):
            return float.__repr__(value)
        if t is dict and TAG not in value and all([type(k) is str for k in value]):
            # Tool arguments and results, a step's keyword arguments: a plain JSON object.
            inner = _deeper(value, depth)
            text = self.text
            parts = []
            for k in sorted(value) if self._sort else value:
                v = value[k]
                tv = type(v)
                # Strings and ints (most arguments and results) as text() prints them.
                if tv is str:
                    parts.append(_json_string(k) + ":" + _json_string(v))
                elif tv is int:
                    parts.append(_json_string(k) + ":" + int.__repr__(v))
                else:
                    parts.append(_json_string(k) + ":" + text(v, inner))
            return "{" + ",".join(parts) + "}"
        if t is Printed and self._sort and depth <= value._depth:  # printed once for two uses
            shared: str = value._text
            return shared
        if isinstance(value, BaseModel):  # a tool outcome, a user's model: never kept
            return self._model(value, depth)
        return self._whole(_encode(value, depth))

    def _model(self, value: BaseModel, depth: int) -> str:
        cls = type(value)
        layout = self._layouts.get(cls)
        if layout is None or layout[0] != cls.__module__ or layout[1] != cls.__qualname__:
            # New, or a class renamed since (see _by_name); compared by its parts, as building
            # its name for every model printed cost a call.
            layout = self._layouts[cls] = self._layout(cls)
        head, keys = layout[2], layout[3]
        inner = _deeper(value, depth)
        fast = _FAST_PRINTS.get(cls)
        if fast is not None:
            kept = fast(self, value, inner, head)
            if kept is not None:
                return kept
        # The leaves most fields hold are printed here, as text() prints them, without a call.
        text = self.text
        parts = []
        for name, key in keys:
            v = getattr(value, name)
            t = type(v)
            if t is str:
                parts.append(key + _json_string(v))
            elif v is None:
                parts.append(key + "null")
            elif t is bool:
                parts.append(key + ("true" if v else "false"))
            else:
                parts.append(key + text(v, inner))
        return head + ",".join(parts) + "}}}"

    def _layout(self, cls: type[BaseModel]) -> _Layout:
        """The fixed parts of a model's text: its tag and class name before the fields (in
        that order either way: "$t" sorts before "v", "cls" before "fields"), and each
        field's quoted key, in the order the encoder prints them."""
        head = f'{{"{TAG}":"model","v":{{"cls":{_json_string(_class_name(cls))},"fields":{{'
        fields = sorted(cls.model_fields) if self._sort else list(cls.model_fields)
        keys = [(field, _json_string(field) + ":") for field in fields]
        return cls.__module__, cls.__qualname__, head, keys


def _print_message(printer: _Printer, m: Any, inner: int, head: str) -> str | None:
    """A :class:`~loomflow.messages.Message`'s text (a transcript prints one per entry), the
    fields written out in the printer's order; ``None`` (print it field by field) when a
    field holds what validation would not leave there (a model built without it)."""
    role, content, calls, call_id, name, error = (
        m.role,
        m.content,
        m.tool_calls,
        m.tool_call_id,
        m.name,
        m.is_error,
    )
    if (
        type(role) is not str
        or type(content) is not str
        or type(calls) is not list
        or type(error) is not bool
        or (call_id is not None and type(call_id) is not str)
        or (name is not None and type(name) is not str)
        or inner >= MAX_DEPTH  # the empty list of calls is refused there too
    ):
        return None
    calls_text = printer.text(calls, inner) if calls else "[]"
    call_id_text = "null" if call_id is None else _json_string(call_id)
    name_text = "null" if name is None else _json_string(name)
    error_text = "true" if error else "false"
    if printer._sort:
        return (
            f'{head}"content":{_json_string(content)},"is_error":{error_text},'
            f'"name":{name_text},"role":{_json_string(role)},"tool_call_id":{call_id_text},'
            f'"tool_calls":{calls_text}}}}}}}'
        )
    return (
        f'{head}"role":{_json_string(role)},"content":{_json_string(content)},'
        f'"tool_calls":{calls_text},"tool_call_id":{call_id_text},"name":{name_text},'
        f'"is_error":{error_text}}}}}}}'
    )


def _print_tool_call(printer: _Printer, call: Any, inner: int, head: str) -> str | None:
    """A :class:`~loomflow.messages.ToolCall`'s text, as :func:`_print_message` prints a
    message."""
    id_, name, arguments = call.id, call.name, call.arguments
    if type(id_) is not str or type(name) is not str:
        return None
    args_text = printer.text(arguments, inner)
    id_text, name_text = _json_string(id_), _json_string(name)
    if printer._sort:
        return f'{head}"arguments":{args_text},"id":{id_text},"name":{name_text}}}}}}}'
    return f'{head}"id":{id_text},"name":{name_text},"arguments":{args_text}}}}}}}'


# Model classes with a printer of their own, keyed by the class (a subclass prints field by
# field): see print_fast.
_FAST_PRINTS: dict[type, Callable[[_Printer, Any, int, str], str | None]] = {}
_FAST_BY_FIELDS = {
    ("role", "content", "tool_calls", "tool_call_id", "name", "is_error"): _print_message,
    ("id", "name", "arguments"): _print_tool_call,
}


def print_fast(cls: type[BaseModel]) -> type[BaseModel]:
    """Print ``cls`` (loomflow's Message and ToolCall, marked immutable) with a printer of
    its own, which writes its fields out without a call per field.

    Raises:
        InvalidArgumentTypeError: ``cls``'s fields are not those of a class with a printer
            (a field added to Message: its printer would leave it out).
    """
    fast = _FAST_BY_FIELDS.get(tuple(cls.model_fields))
    if fast is None or cls not in _values:
        raise InvalidArgumentTypeError(f"{cls!r} has no printer of its own")
    _FAST_PRINTS[cls] = fast
    return cls


_compact_printer = _Printer(_compact, sort=False)  # the stored form
_canonical_printer = _Printer(_canonical_json, sort=True)  # the fingerprinted form
_canonical_text = _canonical_printer.text


def dumps(value: Any) -> bytes:
    """Encode ``value`` to compact UTF-8 JSON bytes (the stored form)."""
    try:
        return _utf8(_compact_printer.text(value, 0))
    except RecursionError:  # a caller already deep in its own stack; same answer as the cap
        raise NestingTooDeepError(value) from None


def valid(value: Any) -> Any:
    """``value`` with every lone surrogate in its text replaced by U+FFFD; ``value`` itself
    (the same object) when it holds none, which is one printing of it to find out.

    The journal stores a lone surrogate faithfully, as its JSON escape, but a text column or
    an audit hash cannot, so what comes from outside (a tool's result, a model's answer) is
    made valid before the run keeps it. A value that holds one is rebuilt through its
    encoding: registered classes come back as themselves, others as their fields.

    Raises:
        UnsupportedValueError: ``value`` has no encoding (see :func:`encode`).
    """
    try:
        _compact_printer.text(value, 0).encode()
        return value
    except UnicodeEncodeError:
        return decode(valid_value(encode(value)))
    except RecursionError:
        raise NestingTooDeepError(value) from None


def plain(value: Any) -> Any:
    """``value`` as plain data that renders the same on the first run and on every replay.

    What a replay hands back is ``loads(dumps(value))``, not ``value``: a set comes back in
    another order (Python orders a set of strings differently in every process), a dict
    with keys that are not strings in the encoding's order, an enum of a class that is not
    registered as its value, a model that is not as a dict of its fields. Text rendered from
    a step's result (a tool result the model reads) is rendered from this instead, which is
    made from that round trip, so the first run and a replay meet by construction: sets
    (sorted by their items' encoding) and tuples become lists, enums their values, models
    and dataclasses dicts of their fields, keys that are not strings the JSON text of their
    plain value. Plain JSON data (the usual tool result) is returned as it is, without the
    round trip; dates, times, decimals, UUIDs and bytes stay as they are.

    Raises:
        UnsupportedValueError: ``value`` has no encoding.
    """
    try:
        if _is_json(value, 0):
            return value
        return _flatten(decode(_encode(value, 0)), 0)
    except RecursionError:
        raise NestingTooDeepError(value) from None


def _is_json(value: Any, depth: int) -> bool:
    """Whether ``value`` is plain JSON data, which the journal hands back as it is."""
    t = type(value)
    if value is None or t is str or t is int or t is bool:
        return True
    if t is float:
        return math.isfinite(value)
    if t is list:
        inner = _deeper(value, depth)
        return all([_is_json(v, inner) for v in value])
    if t is dict:
        inner = _deeper(value, depth)
        return TAG not in value and all(
            [type(k) is str and _is_json(v, inner) for k, v in value.items()]
        )
    return False


def _flatten(value: Any, depth: int) -> Any:
    """A decoded value (the same after another round trip) as plain data in a fixed order."""
    t = type(value)
    if value is None or t is str or t is int or t is float or t is bool:
        return value
    if isinstance(value, enum.Enum):
        return _flatten(value.value, _deeper(value, depth))
    if isinstance(value, list | tuple):
        inner = _deeper(value, depth)
        return [_flatten(v, inner) for v in value]
    if isinstance(value, dict):
        inner = _deeper(value, depth)
        items = list(value.items())
        if not all(type(k) is str for k in value):
            # Sorted as another round trip would store them: the order of the first one was
            # by the keys' encoding before decoding (an enum's differs from its value's).
            items.sort(key=lambda kv: _sort_key(_encode(kv[0], inner)))
        return {_key_text(_flatten(k, inner)): _flatten(v, inner) for k, v in items}
    if isinstance(value, set | frozenset):
        inner = _deeper(value, depth)
        items = sorted(value, key=lambda v: _sort_key(_encode(v, inner)))
        return [_flatten(v, inner) for v in items]
    if isinstance(value, BaseModel):
        inner = _deeper(value, depth)
        return {k: _flatten(getattr(value, k), inner) for k in type(value).model_fields}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = _deeper(value, depth)
        return {f.name: _flatten(getattr(value, f.name), inner) for f in dataclasses.fields(value)}
    return value  # bytes, dates and times, timedelta, Decimal, UUID


def _key_text(key: Any) -> str:
    """The text of a plain value used as an object key: a string as it is, ``true``,
    ``false``, ``null`` and lists as JSON, anything else as ``str()``."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool | list):
        return json.dumps(key, default=str, ensure_ascii=False, separators=(",", ":"))
    return str(key)


def loads(raw: bytes | str, *, version: int = CODEC_VERSION) -> Any:
    """Decode bytes written by :func:`dumps`; see :func:`decode` for what it refuses.

    ``version`` is the codec version stored beside them: one no loomflow writes (below 1, a
    row edited by hand) is damage, not the current version. Callers refuse a newer one first,
    with an error of their own (it is no damage: upgrade).
    """
    if version < 1:
        raise UnknownTagError(f"malformed codec version {version} (none is below 1)")
    if version > CODEC_VERSION:
        raise UnknownTagError(
            f"codec version {version} is newer than this loomflow reads (up to {CODEC_VERSION})"
        )
    try:
        # dumps() writes UTF-8 only; json.loads(bytes) would sniff UTF-16/32 and import
        # their codecs, and decoding must import nothing.
        data = json.loads(raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw)
    except RecursionError:
        # The parser recurses once per bracket: a crafted row of a few thousand nested lists
        # must read as damaged, not take down the resume.
        raise UnknownTagError(f"nested too deep to decode (more than {MAX_DEPTH})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UnknownTagError(f"not valid JSON: {exc}") from exc
    return decode(data)


def canonical_bytes(value: Any) -> bytes:
    """The canonical encoding used for fingerprints: sorted keys, no whitespace, UTF-8."""
    try:
        return _utf8(_canonical_text(value, 0))
    except RecursionError:
        raise NestingTooDeepError(value) from None


# -- a step argument printed once for two hashes ----------------------------------------------


class Printed(dict[str, Any]):
    """A plain JSON object carrying its canonical text, printed at a depth (a tool call's
    arguments: its step's name hashes them, and its fingerprint hashes the same text again).

    It encodes, compares and is passed on as a dict; :func:`canonical_bytes` prints the kept
    text at that depth or a shallower one, byte for byte what it prints for the dict. Built
    by :func:`printed`; nothing may change it afterwards.
    """

    __slots__ = ("_depth", "_text")

    def __init__(self, items: dict[str, Any], text: str, depth: int) -> None:
        super().__init__(items)
        self._text, self._depth = text, depth


def printed(value: Any, depth: int) -> tuple[Any, bytes | None]:
    """``value`` as a :class:`Printed`, and the canonical bytes of it at ``depth``; ``value``
    itself and ``None`` when it is not a plain dict or has no canonical form at that depth
    (whoever prints it next gets the error it gives)."""
    if type(value) is not dict:
        return value, None
    try:
        text = _canonical_text(value, depth)
    except (UnsupportedValueError, RecursionError):
        return value, None
    return Printed(value, text, depth), _utf8(text)


# -- fingerprints of a list that grows from step to step --------------------------------------
#
# A step's inputs are fingerprinted as SHA-256 over canonical_bytes([list(args), kwargs]). The
# agent's model call passes its transcript first, and the transcript only grows: hashing it
# again at every call is O(n) per call and O(n^2) per run. SHA-256 can be resumed from a state,
# so a transcript whose state after its last item is kept costs only its new items.

_GROWING_PREFIX = b"[[["  # the canonical text up to the first item of the first argument
_ITEM_DEPTH = 3  # that item's depth: outer list, argument list, the list itself


class GrowingList(list[Any]):
    """A snapshot of a step's first argument that grows from call to call (the agent's
    transcript), carrying the SHA-256 state of the step-input encoding up to its last item.

    It encodes, compares and iterates as a plain list; :func:`step_fingerprint` uses the state,
    and gives byte for byte what it gives for the plain list. Built by :class:`GrowingHasher`.
    """

    __slots__ = ("_state",)

    def __init__(self, items: list[Any], state: hashlib._Hash) -> None:
        super().__init__(items)
        self._state = state


class GrowingHasher:
    """Hashes the items of a growing list once each, and hands out :class:`GrowingList`
    snapshots. A list that is not the last one plus new items (an item replaced or removed)
    is hashed again from its start."""

    __slots__ = ("_items", "_state")

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._state = hashlib.sha256(_GROWING_PREFIX)

    def snapshot(self, items: list[Any]) -> GrowingList:
        kept = self._items
        # map, not a generator expression: the whole kept prefix is compared on every call.
        if len(items) < len(kept) or any(map(operator.is_not, kept, items)):
            self._items, self._state = [], hashlib.sha256(_GROWING_PREFIX)
            kept = self._items
        state = self._state
        for item in items[len(kept) :]:
            text = _canonical_text(item, _ITEM_DEPTH)
            state.update(_utf8(f",{text}" if kept else text))
            kept.append(item)
        return GrowingList(items, state.copy())


def step_fingerprint(args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]) -> str:
    """SHA-256 (hex) of ``canonical_bytes([list(args), kwargs])``, resumed from the kept state
    when the first argument is a :class:`GrowingList`."""
    first = args[0] if args else None
    if type(first) is not GrowingList:
        return hashlib.sha256(canonical_bytes([list(args), kwargs])).hexdigest()
    try:
        rest = "".join([f",{_canonical_text(a, 2)}" for a in args[1:]])
        tail = f"]{rest}],{_canonical_text(kwargs, 1)}]"
    except RecursionError:
        raise NestingTooDeepError(args) from None
    state: hashlib._Hash = first._state.copy()
    state.update(_utf8(tail))
    return state.hexdigest()
