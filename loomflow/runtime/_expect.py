"""What a journaled step's value must be, as the code that makes the step knows it.

The journal decodes any well-formed entry into plain data or a registered value class, but
only the step's caller knows which of those its result is (a tool call's outcome, a model
call's chunks ending in a response). A caller states it around the step with
:func:`expecting`; a replayed value that fails the check is a damaged entry, handled like
one that does not decode: run again (and replaced), or ``CorruptEntryError`` in strict mode.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

from ..context import reset_var

__all__ = ["expecting", "unexpected"]

_expected: contextvars.ContextVar[tuple[str, Callable[[Any], bool], str] | None] = (
    contextvars.ContextVar("loomflow_expected_step_value", default=None)
)


class expecting:
    """Within the block, a replayed value of step ``step`` must pass ``check`` (``what``
    names what it must be, for the error). Steps of other names are not affected.

    A class rather than a generator-based context manager: it wraps every journaled step of
    an agent's turn, where the generator's cost showed in a replayed turn."""

    __slots__ = ("expected", "token")

    def __init__(self, step: str, check: Callable[[Any], bool], what: str) -> None:
        self.expected = (step, check, what)

    def __enter__(self) -> None:
        self.token = _expected.set(self.expected)

    def __exit__(self, *exc: object) -> None:
        reset_var(_expected, self.token)  # quiet when closed in another context


def unexpected(step: str, value: Any) -> str | None:
    """What ``value`` should have been, if the caller of ``step`` said and it is not."""
    expected = _expected.get()
    if expected is None or expected[0] != step or expected[1](value):
        return None
    return expected[2]
