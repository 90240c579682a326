"""The runtime an agent uses when it has none: every step simply runs."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._cleanup import closing

if TYPE_CHECKING:
    from ..runtime import RunRecord

__all__ = ["Passthrough"]


class Passthrough:
    """No journal: steps run every time, nothing is replayed, runs do not take turns."""

    backend = "none"
    current_run: None = None  # no journal, so never a run open on it
    max_payload_bytes: int | None = None  # nothing is stored, so nothing is too big

    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        idempotency_key: str | None = None,
        **kwargs: Any,
    ) -> Any:
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def stream_step(
        self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        source = fn(*args, **kwargs)
        if inspect.isawaitable(source):
            source = await source
        # Closed with this stream, as a journal closes it: an abandoned call's hooks hear of
        # it now, not when the garbage collector gets to it.
        async with closing(aiter(source)) as chunks:
            async for chunk in chunks:
                yield chunk

    @contextlib.asynccontextmanager
    async def session(
        self,
        session_id: str | None = None,
        user_id: str | None = None,
        *,
        resume: bool = False,
        strict_replay: bool | None = None,
        record: RunRecord | None = None,
    ) -> AsyncIterator[None]:
        yield None

    @contextlib.contextmanager
    def subrun(self, name: str) -> Iterator[tuple[str, ...]]:
        yield ()
