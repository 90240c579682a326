"""The read-only scope of the current run, reachable from anywhere inside it."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, ParamSpec, TypeVar

__all__ = ["RunContext", "get_run_context"]

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RunContext:
    """Who and what the active run is about.

    Tools read it with :func:`get_run_context` instead of taking extra parameters.
    """

    run_id: str | None = None
    session_id: str | None = None
    user_id: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: The run this one was started inside (an agent of a ``Team``, ``Debate`` or
    #: ``Workflow``, or one run from a tool), or ``None`` for a run of its own.
    parent_run_id: str | None = None


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
    # try, not contextlib.suppress: this runs a few times in every turn, and suppress is
    # three Python calls of its own.
    try:
        var.reset(token)
    except ValueError:
        return  # nothing to restore there


def own_context(
    events: Callable[P, AsyncGenerator[T, None]],
) -> Callable[P, AsyncGenerator[T, None]]:
    """Run an async generator in a context of its own, a copy of its reader's.

    A generator runs in the context of whoever iterates it, so the variables a run sets
    (its RunContext, its journal frame, its span) are set in the *reader's* context until the
    generator resets them. A reader that breaks out of ``agent.stream(...)`` and drops it
    never lets it: asyncio's finalizer closes it later in a task of its own, and the reader's
    context kept the dead run's variables. Its next ``agent.resume()`` then took itself for a
    sub-run of that run: it re-ran its tools under a sub-run path, and once the dead run's
    lease had run out failed with OwnershipLostError. Here every step of the generator,
    closing included, runs in the copy: the reader's context never changes.
    """

    @functools.wraps(events)
    async def isolated(*args: P.args, **kwargs: P.kwargs) -> AsyncGenerator[T, None]:
        context = contextvars.copy_context()
        inner = events(*args, **kwargs)
        try:
            while True:
                try:
                    item = await _InContext(context, inner.__anext__())
                except StopAsyncIteration:
                    return
                yield item
        finally:  # closed, abandoned or failed: the inner generator ends in its own context
            await _InContext(context, inner.aclose())

    return isolated


async def in_own_context(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` with every step of it run in a copy of the caller's context.

    For a reader that consumes a whole :func:`own_context` stream in one await (``run()``
    drains it to its result): one copy of the context and one hand-over for the whole run,
    where wrapping the stream paid both for every event. The reader's context never changes,
    as with :func:`own_context`.
    """
    return await _InContext(contextvars.copy_context(), awaitable)


class _InContext(Generic[T]):
    """Await ``awaitable`` with each of its steps run in ``context`` (``Context.run``)."""

    __slots__ = ("_awaitable", "_context")

    def __init__(self, context: contextvars.Context, awaitable: Awaitable[T]) -> None:
        self._context, self._awaitable = context, awaitable

    def __await__(self) -> Generator[Any, Any, T]:
        steps = self._awaitable.__await__()
        run = self._context.run
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                request = run(steps.send, sent) if thrown is None else run(steps.throw, thrown)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]  # the awaitable's T
            sent, thrown = None, None
            try:
                sent = yield request  # a future for the task to wait on, as the step asked
            except GeneratorExit:
                run(steps.close)
                raise
            except BaseException as exc:  # a cancellation, say: the step gets it
                thrown = exc
