"""Plain JSON data and its one canonical spelling, shared by redaction, sealing and audit hashes.

These sit at the bottom of the package so that redaction (which every layer above the
runtime uses) needs nothing from the audit log to turn a value into JSON data.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from typing import Any

from pydantic import BaseModel

__all__ = ["canonical_json", "json_safe", "unfenced", "valid_text", "valid_value"]


# Built once (json.dumps builds an encoder per call when given options).
_canonical = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
).encode


_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n(.*)\n\s*```$", re.DOTALL)


def unfenced(text: str) -> str:
    """The JSON inside a Markdown code fence, which models without native support often add
    to a structured answer (``text`` stripped, when it has none)."""
    stripped = text.strip()
    match = _FENCE.match(stripped)
    return match.group(1) if match else stripped


def canonical_json(value: Any) -> str:
    """The one JSON spelling of ``value`` that hashes are computed over."""
    return _canonical(value)


# Leaves that both walks below hand back as they are: skipped without a call (most of a tool's
# arguments and results are these, and the walks run on every call and result).
_AS_IS = frozenset({int, bool, type(None)})


def valid_text(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD (the replacement character).

    A lone surrogate is no character: UTF-8 cannot spell it, so neither a database's text
    column nor an RFC 8785 hash can hold it. It comes from outside (``json.loads`` of a
    ``"\\udce9"`` escape, half of an emoji cut by a provider); a surrogate pair spelled as two
    code points becomes the character it stands for.
    """
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def valid_line(text: str) -> str:
    """:func:`valid_text`, with each NUL replaced by U+FFFD too: for the prompt and a model's
    answer, which checkpoints and memory episodes keep in text columns, and PostgreSQL text
    cannot hold a NUL (a run that kept one failed at its checkpoint, on every resume too)."""
    text = valid_text(text)
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def valid_value(value: Any) -> Any:
    """``value`` with :func:`valid_text` applied to the strings (keys too) of its dicts, lists
    and tuples; the very same object when nothing needed replacing."""
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, dict):
        items = [
            (valid_value(k), v if type(v) in _AS_IS else valid_value(v)) for k, v in value.items()
        ]
        if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(items, value.items(), strict=True)):
            return value
        return dict(items)
    if isinstance(value, list | tuple):
        out = [v if type(v) in _AS_IS else valid_value(v) for v in value]
        if all(a is b for a, b in zip(out, value, strict=True)):
            return value
        return out if isinstance(value, list) else tuple(out)
    return value


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON data (non-finite floats and unknown objects become strings,
    lone surrogates U+FFFD)."""
    if isinstance(value, str):
        return valid_text(value)
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {
            valid_text(str(k)): v if type(v) in _AS_IS else json_safe(v) for k, v in value.items()
        }
    if isinstance(value, list | tuple | set | frozenset):
        items = [v if type(v) in _AS_IS else json_safe(v) for v in value]
        return sorted(items, key=canonical_json) if isinstance(value, set | frozenset) else items
    if isinstance(value, BaseModel):
        return json_safe(value.model_dump(mode="json"))
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return valid_text(str(value))
