"""The runtime protocol: what the agent loop needs from any journal."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload, runtime_checkable

if TYPE_CHECKING:
    from ._journal import ReplayStats
    from ._store import RunRecord

__all__ = ["OpenRun", "Runtime"]

T = TypeVar("T")


@runtime_checkable
class OpenRun(Protocol):
    """One run a journal has open, as the agent reads it (a :class:`JournalRun`)."""

    @property
    def epoch(self) -> int:
        """The session's epoch the run journals under."""
        ...

    @property
    def resumed(self) -> bool:
        """The run continues one that did not return (it replays what that one journaled)."""
        ...

    @property
    def strict(self) -> bool:
        """A divergence raises instead of running fresh (``strict_replay``)."""
        ...

    @property
    def stats(self) -> ReplayStats:
        """The steps replayed and run fresh so far."""
        ...


@runtime_checkable
class Runtime(Protocol):
    """A journal of steps: what an agent run needs from one.

    :class:`~loomflow.runtime.JournalRuntime` (``InMemoryRuntime``, ``SqliteRuntime``,
    ``PostgresRuntime``) implements it, and so does the journal-less runtime an agent uses
    when it has none (its ``session()`` opens no run: it yields ``None``).
    """

    @property
    def backend(self) -> str:
        """A bounded label for metrics: ``"memory"``, ``"sqlite"``, ``"postgres"``, ..."""
        ...

    @property
    def max_payload_bytes(self) -> int | None:
        """The most bytes one step may store; ``None`` when nothing is stored."""
        ...

    @property
    def current_run(self) -> OpenRun | None:
        """The run open in this context on this runtime, if any."""
        ...

    @overload
    async def step(
        self,
        name: str,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        idempotency_key: str | None = None,
        **kwargs: Any,
    ) -> T: ...

    @overload
    async def step(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        idempotency_key: str | None = None,
        **kwargs: Any,
    ) -> T: ...

    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        idempotency_key: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn`` once per run position; return its journaled result afterwards."""
        ...

    def stream_step(
        self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """Like :meth:`step` for async iterators: chunks are stored and replayed in order."""
        ...

    def session(
        self,
        session_id: str | None = None,
        user_id: str | None = None,
        *,
        resume: bool = False,
        strict_replay: bool | None = None,
        record: RunRecord | None = None,
    ) -> AbstractAsyncContextManager[OpenRun | None]:
        """Open a run on (session, user); steps inside it are journaled under its epoch.

        Yields the open run, or ``None`` from a runtime that keeps no journal. ``record``
        is what a recoverer needs to resume the run without its caller (kept by journals).
        """
        ...

    def subrun(self, name: str) -> AbstractContextManager[tuple[str, ...]]:
        """Key the steps inside the block under a named sub-run of the current run."""
        ...
