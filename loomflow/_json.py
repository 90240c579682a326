"""Plain JSON data and its one canonical spelling, shared by redaction, sealing and audit hashes.

These sit at the bottom of the package so that redaction (which every layer above the
runtime uses) needs nothing from the audit log to turn a value into JSON data.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any

from pydantic import BaseModel

__all__ = ["canonical_json", "json_safe"]


# Built once (json.dumps builds an encoder per call when given options).
_canonical = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
).encode


def canonical_json(value: Any) -> str:
    """The one JSON spelling of ``value`` that hashes are computed over."""
    return _canonical(value)


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON data (non-finite floats and unknown objects become strings)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [json_safe(v) for v in value]
        return sorted(items, key=canonical_json) if isinstance(value, set | frozenset) else items
    if isinstance(value, BaseModel):
        return json_safe(value.model_dump(mode="json"))
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)
