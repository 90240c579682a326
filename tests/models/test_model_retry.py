"""The shared retry loop, without any provider in the way."""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import pickle
import random
from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from loomflow.errors import InvalidArgumentError, ModelError, ModelRetryExhaustedError
from loomflow.messages import ModelChunk, ModelResponse, TextDelta
from loomflow.models import Backoff
from loomflow.models._retry import (
    Failure,
    MalformedStreamError,
    SdkEvents,
    error_class,
    parse_retry_after,
    read_sdk,
    retry_after_from,
    stream_with_retries,
)


class Flaky(Exception):
    pass


def fail(exc: Exception) -> None:
    raise exc


def test_backoff_grows_caps_and_jitters() -> None:
    backoff = Backoff(initial=1.0, maximum=8.0, multiplier=2.0)
    rng = random.Random(7)
    for retry, base in enumerate([1.0, 2.0, 4.0, 8.0, 8.0, 8.0]):
        waits = {backoff.delay(retry, rng) for _ in range(50)}
        assert all(base / 2 <= w <= base for w in waits)
        assert len(waits) > 1  # jittered, not lockstep


@pytest.mark.parametrize(
    "options",
    [
        {"maximum": float("inf")},  # a hostile "retry-after: 1e9" then waited that long
        {"maximum": float("nan")},
        {"initial": -1.0},
        {"multiplier": float("inf")},
        {"maximum": "8"},
    ],
)
def test_a_backoff_that_cannot_bound_a_wait_is_refused(options: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError, match="Backoff"):
        Backoff(**options)  # type: ignore[arg-type]


def test_retry_after_is_honoured_up_to_the_cap() -> None:
    backoff = Backoff(initial=0.1, maximum=5.0)
    rng = random.Random(1)
    assert backoff.delay(0, rng, retry_after=3.0) == 3.0
    assert backoff.delay(0, rng, retry_after=60.0) == 5.0


@pytest.mark.parametrize(
    ("header", "seconds"), [("2", 2.0), ("0.5", 0.5), (None, None), ("soon", None), ("-1", None)]
)
def test_parse_retry_after(header: str | None, seconds: float | None) -> None:
    assert parse_retry_after(header) == seconds


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("Sun, 06 Dec 2026 05:00:30 GMT", 30.0),  # an HTTP-date: the seconds until then
        ("Sun, 06 Dec 2026 04:59:00 GMT", 0.0),  # in the past: retry at once
        ("Sun, 06 Dec 2026 05:00:30", 30.0),  # no zone: read as GMT
        ("Sun, 99 Foo 2026 05:00:30 GMT", None),
        ("nan", None),
        ("inf", math.inf),  # capped by Backoff.delay, like any long wait
        ("1e400", math.inf),
    ],
)
def test_parse_retry_after_dates_and_odd_numbers(header: str, seconds: float | None) -> None:
    now = datetime.datetime(2026, 12, 6, 5, 0, tzinfo=datetime.UTC).timestamp()
    assert parse_retry_after(header, now=now) == seconds


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after-ms": "soon", "retry-after": "9"}, 9.0),
        ({"retry-after-ms": "-5"}, None),
        ({}, None),
        (None, None),
    ],
)
def test_retry_after_from_headers(headers: dict[str, str] | None, seconds: float | None) -> None:
    assert retry_after_from(headers) == seconds


def _classify(exc: Exception) -> Failure | None:
    if isinstance(exc, Flaky):
        return Failure(str(exc), 503, retryable=True)
    return None


async def _collect(attempt: object, max_retries: int = 3) -> list[ModelChunk]:
    stream = stream_with_retries(
        attempt,  # type: ignore[arg-type]
        _classify,
        provider="fake",
        model="m",
        max_retries=max_retries,
        backoff=Backoff(initial=0.0001, maximum=0.0002),
        rng=random.Random(0),
    )
    return [c async for c in stream]


async def test_failures_before_output_are_retried() -> None:
    attempts = 0

    async def attempt() -> AsyncGenerator[ModelChunk, None]:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise Flaky("busy")
        yield TextDelta(text="hi")
        yield ModelResponse(text="hi")

    assert await _collect(attempt) == [TextDelta(text="hi"), ModelResponse(text="hi")]
    assert attempts == 3


async def test_a_failure_after_output_is_not_retried() -> None:
    attempts = 0

    async def attempt() -> AsyncGenerator[ModelChunk, None]:
        nonlocal attempts
        attempts += 1
        yield TextDelta(text="hi")
        raise Flaky("dropped")

    with pytest.raises(ModelError, match="not retried") as info:
        await _collect(attempt)
    assert attempts == 1
    assert info.value.status == 503


async def test_exhaustion_counts_attempts() -> None:
    async def attempt() -> AsyncGenerator[ModelChunk, None]:
        fail(Flaky("busy"))
        yield TextDelta(text="never")

    with pytest.raises(ModelRetryExhaustedError) as info:
        await _collect(attempt, max_retries=2)
    assert info.value.attempts == 3


async def test_unclassified_exceptions_propagate_unchanged() -> None:
    async def attempt() -> AsyncGenerator[ModelChunk, None]:
        fail(KeyError("bug"))
        yield TextDelta(text="never")

    with pytest.raises(KeyError):
        await _collect(attempt)


async def test_closing_the_stream_early_closes_the_attempt() -> None:
    closed = False

    async def attempt() -> AsyncGenerator[ModelChunk, None]:
        nonlocal closed
        try:
            yield TextDelta(text="a")
            yield TextDelta(text="b")
        finally:
            closed = True

    stream = stream_with_retries(
        attempt,
        _classify,
        provider="fake",
        model="m",
        max_retries=0,
        backoff=Backoff(),
        rng=random.Random(0),
    )
    async for _ in stream:
        break
    await stream.aclose()  # type: ignore[attr-defined]
    assert closed


@pytest.mark.parametrize(
    "error",
    [
        ModelError("openai", "gpt-4.1", "boom", 500),
        ModelRetryExhaustedError("anthropic", "claude-opus-4-7", "overloaded", 529, attempts=4),
    ],
)
def test_model_errors_survive_pickling(error: ModelError) -> None:
    restored = pickle.loads(pickle.dumps(error))  # noqa: TID251 - checking picklability itself
    assert type(restored) is type(error)
    assert str(restored) == str(error)
    assert (restored.provider, restored.model, restored.status) == (
        error.provider,
        error.model,
        error.status,
    )


async def _events(exc: BaseException) -> AsyncIterator[str]:
    yield "first"
    raise exc


async def _read_all(events: AsyncIterator[str]) -> list[str]:
    return [e async for e in SdkEvents(events)]


@pytest.mark.parametrize(
    "exc",
    [
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
        json.JSONDecodeError("Expecting value", "{x", 1),
        IndexError("list index out of range"),
        AssertionError(),
        TypeError("can only concatenate str"),
        ValueError("Unable to parse tool parameter JSON"),
    ],
)
async def test_the_sdk_failing_on_malformed_data_is_a_malformed_stream(exc: Exception) -> None:
    with pytest.raises(MalformedStreamError, match=type(exc).__name__) as info:
        await _read_all(_events(exc))
    assert info.value.__cause__ is exc

    async def final() -> str:
        raise exc

    with pytest.raises(MalformedStreamError):
        await read_sdk(final())


@pytest.mark.parametrize(
    "exc", [asyncio.CancelledError(), KeyboardInterrupt(), Flaky("transport"), OSError("reset")]
)
async def test_cancellation_and_other_failures_pass_through_the_sdk_stream(
    exc: BaseException,
) -> None:
    with pytest.raises(type(exc)) as info:
        await _read_all(_events(exc))
    assert info.value is exc


def test_a_malformed_stream_is_not_counted_as_a_connection_failure() -> None:
    error = ModelError("openai", "gpt-4.1", "malformed response stream: choices is missing")
    error.__cause__ = MalformedStreamError("choices is missing")
    assert error_class(None, error) == "other"
