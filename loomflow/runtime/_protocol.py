"""The runtime protocol: what the agent loop needs from any journal."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Protocol, TypeVar, overload, runtime_checkable

__all__ = ["Runtime"]

T = TypeVar("T")


@runtime_checkable
class Runtime(Protocol):
    """A journal of steps. Implement these three calls to bring your own durable engine."""

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
    ) -> AbstractAsyncContextManager[Any]:
        """Open a run on (session, user); steps inside it are journaled under its epoch."""
        ...

    def subrun(self, name: str) -> AbstractContextManager[tuple[str, ...]]:
        """Key the steps inside the block under a named sub-run of the current run."""
        ...
