"""``runtime.step("charge", charge(order))`` is refused with a typed error that shows the fix.

Calling the body yourself hands the journal a coroutine instead of a function. Before, a fresh
step raised a bare ``TypeError: 'coroutine' object is not callable`` (after taking the run's
turn) and Python warned that the coroutine was never awaited, while a replayed step returned
the journaled result and hid the mistake until the first fresh run.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from loomflow.errors import InvalidArgumentTypeError
from loomflow.runtime import JournalRuntime

Factory = Callable[..., Awaitable[JournalRuntime]]


async def charge(order: str) -> dict[str, str]:
    return {"order": order, "receipt": "r-1"}


async def chunks(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i


async def test_a_called_body_is_refused_with_the_fix_fresh_and_on_replay(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()
    for attempt in ("fresh", "replay"):
        async with runtime.session("s", user_id="u", resume=attempt == "replay") as run:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "coroutine was never awaited" either
                with pytest.raises(InvalidArgumentTypeError) as caught:
                    await runtime.step("charge", charge("o-1"))  # type: ignore[arg-type]
            assert isinstance(caught.value, TypeError)
            assert "write runtime.step('charge', charge, *args, **kwargs)" in str(caught.value)
            # Nothing was journaled and the name is still free: the right call goes on.
            assert await runtime.step("charge", charge, "o-1") == {"order": "o-1", "receipt": "r-1"}
        assert (run.stats.hits, run.stats.misses) == ((1, 0) if attempt == "replay" else (0, 1))


async def test_a_called_stream_or_a_plain_value_is_refused_too(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()
    async with runtime.session("s", user_id="u"):
        with pytest.raises(InvalidArgumentTypeError, match=r"calling chunks\(\.\.\.\) returned"):
            async for _ in runtime.stream_step("tokens", chunks(3)):  # type: ignore[arg-type]
                pass
        with pytest.raises(InvalidArgumentTypeError, match="takes a function to call, not a dict"):
            await runtime.step("charge", {"order": "o-1"})  # type: ignore[arg-type]
        assert [c async for c in runtime.stream_step("tokens", chunks, 3)] == [0, 1, 2]
