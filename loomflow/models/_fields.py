"""Checks on the fields the adapters read from a provider's stream.

The SDKs build their event objects from the wire without validating them, so a field may hold
any JSON value, or be missing. What an adapter reads is checked here before it goes into a
loomflow object: a field of the wrong type raises :class:`MalformedStreamError` naming the
field and what it held, which the adapters report as a :class:`~loomflow.errors.ModelError`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ._retry import MalformedStreamError

__all__ = ["field", "index", "items", "obj", "optional_obj", "optional_text", "text"]


def field(owner: Any, name: str) -> Any:
    """``owner.name``, or ``None`` when the provider left it out (the SDKs leave a missing
    required field unset rather than ``None``)."""
    return getattr(owner, name, None)


def _show(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _bad(where: str, value: Any, expected: str) -> MalformedStreamError:
    what = "missing or null" if value is None else _show(value)
    return MalformedStreamError(f"{where} is {what}, not {expected}")


def optional_text(value: Any, where: str) -> str | None:
    """A string field that may be absent."""
    return None if value is None else text(value, where)


def text(value: Any, where: str) -> str:
    """A string field that must be there."""
    if isinstance(value, str):
        return value
    raise _bad(where, value, "a string")


def index(value: Any, where: str) -> int:
    """A position: an integer from 0."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise _bad(where, value, "an index (an integer from 0)")


def optional_obj(value: Any, where: str) -> Any:
    """An object field (the SDK's model of a JSON object) that may be absent."""
    return None if value is None else obj(value, where)


def obj(value: Any, where: str) -> Any:
    """An object field that must be there."""
    if isinstance(value, BaseModel):
        return value
    raise _bad(where, value, "an object")


def items(value: Any, where: str) -> list[Any]:
    """A list field that must be there."""
    if isinstance(value, list):
        return value
    raise _bad(where, value, "a list")
