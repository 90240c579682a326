"""The one retry policy of the provider adapters.

The SDKs' own retries are switched off (``max_retries=0``) so that this is the only policy:
two stacked policies would multiply attempts (4 x 4 = 16 requests for one call) and hide them
from our logs and metrics.

A call is retried only while nothing has been yielded to the caller. Once a chunk is out,
starting again would hand the caller the same text twice, so a failure after that point is
raised as it is.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Final

from ..errors import ModelError, ModelRetryExhaustedError
from ..messages import ModelChunk

__all__ = [
    "ERROR_CLASSES",
    "Backoff",
    "Failure",
    "IncompleteStreamError",
    "RetryObserver",
    "error_class",
    "observe_retries",
    "stream_with_retries",
]

logger = logging.getLogger("loomflow.models")

# Statuses worth another attempt: timeouts, rate limits and server-side failures (Anthropic
# uses 529 for "overloaded"). Other 4xx mean the request itself is wrong.
_RETRYABLE_STATUS = frozenset({408, 429})


RetryObserver = Callable[[str, str, "int | None", BaseException], None]
"""Told of every retry: ``(provider, model, status or None, the exception retried)``."""

_observers: list[RetryObserver] = []


def observe_retries(observer: RetryObserver) -> None:
    """Call ``observer`` before every retry of every adapter (idempotent per observer).

    Telemetry counts retries this way: the SDKs' own retries are off, so this loop is the only
    place that knows a call was attempted again.
    """
    if observer not in _observers:
        _observers.append(observer)


ERROR_CLASSES: Final = ("rate_limit", "timeout", "connection", "server", "client", "other")
"""What kind of failure a provider call had (the ``error`` label of error and retry metrics)."""


def error_class(status: int | None, exc: BaseException | None = None) -> str:
    """One of :data:`ERROR_CLASSES` for a failed provider call (HTTP ``status``, if any)."""
    if status is not None:
        if status == 429:
            return "rate_limit"
        if status == 408:
            return "timeout"
        if status >= 500:
            return "server"
        return "client" if 400 <= status < 500 else "other"
    # No status: the cause tells a timeout from a lost connection (ModelError wraps it).
    for found in (exc, getattr(exc, "__cause__", None)):
        if found is None:
            continue
        if isinstance(found, TimeoutError) or "Timeout" in type(found).__name__:
            return "timeout"
    names = {type(e).__name__ for e in (exc, getattr(exc, "__cause__", None)) if e is not None}
    if isinstance(exc, ModelError | ConnectionError) or names & _CONNECTION_ERRORS:
        return "connection"
    return "other"


_CONNECTION_ERRORS = frozenset(
    {
        "APIConnectionError", "ConnectError", "ReadError", "RemoteProtocolError",
        "TransportError", "IncompleteStreamError", "ConnectionError",
    }
)  # fmt: skip


def is_retryable_status(status: int) -> bool:
    """Whether an HTTP status is transient."""
    return status in _RETRYABLE_STATUS or status >= 500


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter between attempts.

    The n-th retry waits about ``initial * multiplier**n`` seconds, capped at ``maximum``; half
    of that wait is random so that many workers hitting the same overloaded provider spread out
    instead of retrying in lockstep. A ``retry-after`` header from the provider is honoured up
    to ``maximum``.

    Attributes:
        initial: Base wait before the first retry, in seconds.
        maximum: Longest wait between two attempts, in seconds.
        multiplier: Growth factor per retry.
    """

    initial: float = 0.5
    maximum: float = 8.0
    multiplier: float = 2.0

    def delay(self, retry: int, rng: random.Random, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        base = min(self.maximum, self.initial * self.multiplier**retry)
        wait = base / 2 + rng.uniform(0, base / 2)
        if retry_after is not None and retry_after > wait:
            wait = min(retry_after, self.maximum)
        return wait


@dataclass(frozen=True)
class Failure:
    """What an adapter's classifier learned from a provider exception."""

    detail: str
    status: int | None
    retryable: bool
    retry_after: float | None = None


class IncompleteStreamError(Exception):
    """The provider's stream ended before its end-of-message marker (a dropped connection)."""


def transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level exception classes of the HTTP library under the SDKs.

    Newer SDKs sit on ``httpx2``, older ones on ``httpx``; a body cut mid-stream surfaces as one
    of these rather than as an SDK exception.
    """
    found: list[type[BaseException]] = []
    for name in ("httpx2", "httpx"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        found.append(module.TransportError)
    return tuple(found)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``retry-after`` header; HTTP-date forms are ignored."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


async def stream_with_retries(
    attempt: Callable[[], AsyncGenerator[ModelChunk, None]],
    classify: Callable[[Exception], Failure | None],
    *,
    provider: str,
    model: str,
    max_retries: int,
    backoff: Backoff,
    rng: random.Random,
) -> AsyncIterator[ModelChunk]:
    """Yield the chunks of ``attempt()``, starting it again on transient failures.

    Args:
        attempt: Opens one provider stream and yields neutral chunks.
        classify: Maps an exception to a :class:`Failure`, or ``None`` for exceptions that are
            not provider failures (programming errors), which propagate unchanged.
        provider: Provider label for errors and logs.
        model: Model id for errors and logs.
        max_retries: Retries after the first attempt.
        backoff: Waits between attempts.
        rng: Source of jitter.
    """
    retries = 0
    while True:
        started = False
        try:
            async with aclosing(attempt()) as chunks:
                async for chunk in chunks:
                    started = True
                    yield chunk
            return
        except ModelError:
            raise
        except Exception as exc:
            failure = classify(exc)
            if failure is None:
                raise
            if started:
                raise ModelError(
                    provider,
                    model,
                    f"{failure.detail} (the stream had already produced output, so it was "
                    "not retried)",
                    failure.status,
                ) from exc
            if not failure.retryable:
                raise ModelError(provider, model, failure.detail, failure.status) from exc
            if retries >= max_retries:
                raise ModelRetryExhaustedError(
                    provider, model, failure.detail, failure.status, attempts=retries + 1
                ) from exc
            wait = backoff.delay(retries, rng, failure.retry_after)
            retries += 1
            for observer in _observers:
                try:
                    observer(provider, model, failure.status, exc)
                except Exception:  # counting a retry must never fail the call
                    logger.exception("retry observer %r failed", observer)
            logger.warning(
                "%s model %r: transient failure (%s), retry %d/%d in %.2fs",
                provider,
                model,
                failure.status if failure.status is not None else "connection",
                retries,
                max_retries,
                wait,
            )
            await asyncio.sleep(wait)
