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
import datetime
import email.utils
import importlib
import json
import logging
import math
import random
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
)
from contextlib import aclosing
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from ..errors import InvalidArgumentError, ModelError, ModelRetryExhaustedError
from ..messages import ModelChunk

__all__ = [
    "ERROR_CLASSES",
    "Backoff",
    "Failure",
    "IncompleteStreamError",
    "MalformedStreamError",
    "RetryObserver",
    "error_class",
    "observe_retries",
    "parse_retry_after",
    "retry_after_from",
    "stream_error_status",
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
    if any(isinstance(e, MalformedStreamError) for e in (exc, getattr(exc, "__cause__", None))):
        return "other"  # the connection was fine; what came over it was not
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


# Error types and codes that an error object inside a 200 stream can carry, with the HTTP
# status each stands for (Anthropic's types, OpenAI's types and codes). The request errors are
# not retried either way; their status keeps the error metric from counting them as lost
# connections.
_STREAM_ERROR_STATUS: Final = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "overloaded_error": 529,
    "api_error": 500,
    "server_error": 500,
    "rate_limit_error": 429,
    "rate_limit_exceeded": 429,
    "timeout_error": 504,
}


def stream_error_status(body: object) -> int | None:
    """The HTTP status that an error sent inside a 200 stream stands for, or ``None``.

    ``body`` is the error event's JSON: an ``error`` object, or one holding it. Its ``type``,
    then its ``code``, is read: a kind above, or a code that is itself an HTTP status (Azure
    OpenAI sends ``"code": "429"``). An error given so is retried as that status would be.
    """
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        body = body["error"]
    if not isinstance(body, Mapping):
        return None
    for key in ("type", "code"):
        kind = body.get(key)
        if isinstance(kind, int) and not isinstance(kind, bool):
            kind = str(kind)
        if not isinstance(kind, str):
            continue
        if kind in _STREAM_ERROR_STATUS:
            return _STREAM_ERROR_STATUS[kind]
        if len(kind) == 3 and kind.isascii() and kind.isdigit() and 400 <= int(kind) <= 599:
            return int(kind)
    return None


def not_json(text: str) -> str:
    """Says that ``text``, what an event held, is not JSON, quoting it cut to 300 characters."""
    more = f" ({len(text) - 300} more characters)" if len(text) > 300 else ""
    return f"not JSON: {text[:300]!r}{more}"


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter between attempts.

    The n-th retry waits about ``initial * multiplier**n`` seconds, capped at ``maximum``; half
    of that wait is random so that many workers hitting the same overloaded provider spread out
    instead of retrying in lockstep. A ``retry-after`` header from the provider (seconds or an
    HTTP-date; ``retry-after-ms`` first when sent) is honoured up to ``maximum``.

    Attributes:
        initial: Base wait before the first retry, in seconds.
        maximum: Longest wait between two attempts, in seconds.
        multiplier: Growth factor per retry.
    """

    initial: float = 0.5
    maximum: float = 8.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        # The maximum is what bounds a provider's retry-after header ("inf" included): an
        # infinite or NaN one would let a hostile header stall the call for good.
        for name in ("initial", "maximum", "multiplier"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise InvalidArgumentError(
                    f"Backoff {name} must be a finite number from 0, not {value!r}"
                )

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
    # The provider's exception quoted a secret the detail has cut out: it is not chained to
    # the ModelError, or every printed traceback would show the secret again.
    conceal_cause: bool = False


class IncompleteStreamError(Exception):
    """The provider's stream ended before its end-of-message marker (a dropped connection)."""


class MalformedStreamError(Exception):
    """The provider's stream holds what its API never sends: a field of the wrong type, events
    out of order, a body that is not UTF-8 or not JSON.

    The adapters raise it when a field they read is not what the wire format says, and
    :class:`SdkEvents` raises it for the errors an SDK itself hits on such data. It is not a
    transient failure: the adapters turn it into a :class:`ModelError` that is not retried.
    """


# What the SDKs raise while decoding and accumulating a stream whose data does not fit the
# wire format: UnicodeDecodeError, json.JSONDecodeError and pydantic's ValidationError are
# ValueErrors; events out of order or of the wrong shape end in a TypeError, AttributeError,
# IndexError/KeyError or a failed assertion inside the SDK. Only exceptions raised by the
# SDK's stream are translated (see SdkEvents), never those of loomflow's own code.
_SDK_DATA_ERRORS: Final = (ValueError, TypeError, AttributeError, LookupError, AssertionError)

T = TypeVar("T")


class SdkEvents(Generic[T]):
    """An SDK stream's events, with the SDK's own errors on malformed data (see
    :data:`_SDK_DATA_ERRORS`) raised as :class:`MalformedStreamError`.

    Only the SDK's ``__anext__`` is guarded: an exception from the code that handles an event
    (the adapter's) is not the stream's and propagates unchanged. SDK and transport errors
    (``APIError``, ``httpx.TransportError``), cancellation and ``KeyboardInterrupt`` are not
    of those types and pass through as they are.

    With ``ended`` and ``drops``: a connection lost (one of ``drops``) once ``ended()`` says the
    provider's end-of-message marker has come ends the events instead. The answer is whole and
    billed; failing the call for the close of the connection had a resume pay for it again.
    """

    def __init__(
        self,
        events: AsyncIterable[T],
        *,
        ended: Callable[[], bool] | None = None,
        drops: tuple[type[BaseException], ...] = (),
    ) -> None:
        self._events = events.__aiter__()
        self._ended = ended
        self._drops = drops

    def __aiter__(self) -> SdkEvents[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self._events.__anext__()
        except _SDK_DATA_ERRORS as exc:
            raise malformed_sdk_data(exc) from exc
        except self._drops as exc:
            if self._ended is not None and self._ended():
                raise StopAsyncIteration from exc
            raise


def malformed_sdk_data(exc: BaseException) -> MalformedStreamError:
    """The :class:`MalformedStreamError` for an error the SDK raised reading the stream."""
    detail = str(exc).splitlines()[0][:300] if str(exc) else ""
    said = (
        f"the SDK could not read the stream ({type(exc).__name__}{': ' if detail else ''}{detail})"
    )
    if isinstance(exc, json.JSONDecodeError):
        # What the event held, e.g. a proxy's "event: error" in plain text.
        said += f": an event's data is {not_json(exc.doc)}"
    return MalformedStreamError(said)


async def read_sdk(operation: Awaitable[T]) -> T:
    """Await an SDK call that reads the rest of the stream (e.g. the final message), with the
    SDK's errors on malformed data raised as :class:`MalformedStreamError`."""
    try:
        return await operation
    except _SDK_DATA_ERRORS as exc:
        raise malformed_sdk_data(exc) from exc


def ended_early(response: object, missing: str) -> Exception:
    """The error for a stream that ended without its end-of-message marker (``missing`` says
    which): a lost connection, to retry, unless the answer was no event stream at all.

    A server that ignores ``"stream": true`` answers with the whole JSON body, in which the
    SDK finds no events: that is no dropped connection, and sending the (billed) request again
    gets the same answer.
    """
    headers = getattr(response, "headers", None)
    kind = headers.get("content-type") if isinstance(headers, Mapping) else None
    if isinstance(kind, str) and kind and "text/event-stream" not in kind.lower():
        return MalformedStreamError(
            f"the server answered with a {kind[:100]!r} body, not an event stream: it does not "
            'stream answers (it ignores "stream": true), which loomflow needs'
        )
    return IncompleteStreamError(missing)


def connection_detail(exc: BaseException) -> str:
    """What a lost connection says, with the cause an SDK's own message leaves out (the OpenAI
    SDK's is "Connection error." for a refused connection and a reset stream alike)."""
    detail = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    said = str(cause).splitlines()[0][:300] if cause is not None and str(cause) else ""
    if said and said not in detail:
        detail += f" ({type(cause).__name__}: {said})"
    return detail


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


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds from a ``retry-after`` header: a number of seconds, or an HTTP-date (RFC 9110)
    turned into the seconds from ``now`` (``time.time()`` by default; a past date is 0).
    Anything else, a negative number or NaN, is ``None``."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:  # HTTP-dates are GMT; a zone-less one is read as such
            when = when.replace(tzinfo=datetime.UTC)
        try:
            seconds = when.timestamp() - (time.time() if now is None else now)
        except (OverflowError, OSError, ValueError):
            return None
        return max(seconds, 0.0)
    # An absurdly long wait (even "inf") stays one: Backoff.delay caps it at its maximum.
    return None if math.isnan(seconds) or seconds < 0 else seconds


def retry_after_from(headers: Mapping[str, str] | None) -> float | None:
    """The wait a response's headers ask for, in seconds: ``retry-after-ms`` (milliseconds,
    which OpenAI and Anthropic send) when it holds a valid number, else ``retry-after``."""
    if headers is None:
        return None
    try:
        millis = float(headers.get("retry-after-ms") or "nan")
    except ValueError:
        millis = math.nan
    if not math.isnan(millis) and millis >= 0:
        return millis / 1000
    return parse_retry_after(headers.get("retry-after"))


_MAX_DETAIL = 1000


def _clipped(detail: str) -> str:
    """``detail`` cut to :data:`_MAX_DETAIL` characters: a gateway's error page (tens of KB of
    HTML) would otherwise be the error's message whole, and so fill the audit trail and logs."""
    if len(detail) <= _MAX_DETAIL:
        return detail
    return f"{detail[:_MAX_DETAIL]}... ({len(detail) - _MAX_DETAIL} more characters)"


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
            detail = _clipped(failure.detail)
            cause = None if failure.conceal_cause else exc
            if started:
                raise ModelError(
                    provider,
                    model,
                    f"{detail} (the stream had already produced output, so it was not retried)",
                    failure.status,
                ) from cause
            if not failure.retryable:
                raise ModelError(provider, model, detail, failure.status) from cause
            if retries >= max_retries:
                raise ModelRetryExhaustedError(
                    provider, model, detail, failure.status, attempts=retries + 1
                ) from cause
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
