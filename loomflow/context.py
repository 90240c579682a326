"""The read-only scope of the current run, reachable from anywhere inside it."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["RunContext", "get_run_context"]


@dataclass(frozen=True, slots=True)
class RunContext:
    """Who and what the active run is about.

    Tools read it with :func:`get_run_context` instead of taking extra parameters.
    """

    run_id: str | None = None
    session_id: str | None = None
    user_id: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


_EMPTY = RunContext()
_current: contextvars.ContextVar[RunContext] = contextvars.ContextVar(
    "loomflow_run_context", default=_EMPTY
)


def get_run_context() -> RunContext:
    """Return the active run's context, or an empty one outside any run. Never raises."""
    return _current.get()


@contextmanager
def use_run_context(ctx: RunContext) -> Iterator[RunContext]:
    """Make ``ctx`` the active run context for the block (framework use)."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        reset_var(_current, token)


def reset_var(var: contextvars.ContextVar[Any], token: contextvars.Token[Any]) -> None:
    """``var.reset(token)``, unless the block ends in another context than it began in.

    An async generator abandoned by its reader (``break`` out of ``agent.stream(...)``) is
    closed later by asyncio's finalizer, in a task of its own: there the token belongs to a
    context that is gone, ``reset`` raises ``ValueError``, and the rest of the cleanup (the
    journal's release, the run's spans) would be skipped. Nothing needs restoring there.
    """
    with suppress(ValueError):
        var.reset(token)
