"""Cleanup that runs while an error propagates must not replace that error.

When a run fails (the budget store is down, a tool raised) and the cleanup after it fails too
(giving the session's turn back to the same unreachable database), the caller must see the
first error, the one that says what went wrong. The cleanup's failure is attached to it: as a
note in the traceback, and in the ``cleanup_errors`` list on the exception.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Final, Generic, TypeVar

from .errors import OwnershipLostError, RunCancelledError

__all__ = [
    "CANCELLATIONS",
    "attach_cleanup_error",
    "cleanup_errors",
    "closing",
    "end_outcome",
    "raise_if_cancelled",
    "run_cleanup",
]

log = logging.getLogger("loomflow")

T = TypeVar("T")

CANCELLATIONS: Final = (asyncio.CancelledError, GeneratorExit, KeyboardInterrupt, RunCancelledError)
"""What ends a run as ``cancelled``, not ``failed``: its caller went away (the task was
cancelled, the stream closed, Ctrl-C) or someone cancelled the run (``runtime.cancel``). The
metrics, the spans and the audit trail's ``run.end`` classify a run's end with this one list."""


def end_outcome(error: BaseException) -> str:
    """How a run that raised ``error`` ended, as the metrics, spans and ``run.end`` say it:
    ``cancelled`` (:data:`CANCELLATIONS`), ``claim_lost`` (another owner took the run over,
    :class:`~loomflow.errors.OwnershipLostError`: the new owner decides how it ends, so this
    process must not count it as failed), or ``failed``."""
    if isinstance(error, CANCELLATIONS):
        return "cancelled"
    return "claim_lost" if isinstance(error, OwnershipLostError) else "failed"


def attach_cleanup_error(first: BaseException, cleanup: BaseException, what: str) -> None:
    """Record on ``first`` that ``what`` failed with ``cleanup`` while ``first`` propagated."""
    log.warning("%s failed after %s", what, type(first).__name__, exc_info=cleanup)
    first.add_note(f"while handling it, {what} failed: {type(cleanup).__name__}: {cleanup}")
    try:
        errors = first.__dict__.setdefault("cleanup_errors", [])
    except AttributeError:  # an exception type without a __dict__: the note must do
        return
    errors.append(cleanup)


def cleanup_errors(exc: BaseException) -> list[BaseException]:
    """The cleanup failures attached to ``exc`` (oldest first); empty if none."""
    found = getattr(exc, "cleanup_errors", None)
    return list(found) if isinstance(found, list) else []


async def run_cleanup(first: BaseException, what: str, cleanup: Awaitable[object]) -> None:
    """Await ``cleanup`` while ``first`` propagates; a failure is attached to ``first``.

    Only ``Exception`` is caught: a cancellation during cleanup still cancels.
    """
    try:
        await cleanup
    except Exception as exc:
        attach_cleanup_error(first, exc, what)


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if this task was asked to stop, even if the error was lost.

    A background loop that logs errors and goes on (a lease or reservation heartbeat) calls
    this in its handler: ``asyncio.wait_for`` before Python 3.12, which asyncpg times its
    statements with, can turn a cancellation that arrives as the timeout fires into a plain
    ``TimeoutError``, and the loop would then never end. The task still counts the request.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class closing(Generic[T]):
    """``stream``, closed when the block ends if it can be (``contextlib.aclosing`` for an
    iterator that may have no ``aclose``): one left open is closed only when the garbage
    collector gets to it, after the code that reads it has gone on. A class, not a generator:
    it wraps every model call's stream."""

    __slots__ = ("stream",)

    def __init__(self, stream: AsyncIterator[T]) -> None:
        self.stream = stream

    async def __aenter__(self) -> AsyncIterator[T]:
        return self.stream

    async def __aexit__(self, *exc_info: object) -> None:
        aclose = getattr(self.stream, "aclose", None)
        if aclose is not None:
            await aclose()
