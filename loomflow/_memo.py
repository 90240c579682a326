"""What was worked out for one instance of an immutable value, kept while the instance lives.

loomflow's messages, tool calls and responses are frozen models that nobody changes after
building them, and a run hands the same instances around turn after turn: the transcript a
model call fingerprints, encodes, redacts and counts tokens of is the last one plus two new
messages. Keeping each instance's result turns those O(n^2) walks of a growing list into one
walk per message.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

__all__ = ["PerInstance"]

V = TypeVar("V")


class PerInstance(Generic[V]):
    """A result per live instance, with a tag that must match (a depth, a generation).

    Keyed by ``id()`` with a weak reference that both proves the entry is this instance's
    (an id is reused once its object is gone) and drops the entry when the instance goes.
    Only for instances that are hashable by weak reference and never change.
    """

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict[int, tuple[weakref.ref[Any], int, V]] = {}

    def get(self, instance: object, tag: int, *, at_most: bool = False) -> V | None:
        """The kept result for ``instance`` made with ``tag`` (or, with ``at_most``, with a
        tag at least ``tag``), else ``None``."""
        kept = self._kept.get(id(instance))
        if kept is None or kept[0]() is not instance:
            return None
        if kept[1] == tag or (at_most and tag <= kept[1]):
            return kept[2]
        return None

    def put(self, instance: object, tag: int, result: V) -> None:
        key = id(instance)
        pop = self._kept.pop
        self._kept[key] = (weakref.ref(instance, lambda _ref: pop(key, None)), tag, result)

    def __len__(self) -> int:
        return len(self._kept)
