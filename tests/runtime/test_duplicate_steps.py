"""A run that reaches one step name twice is told so (``DuplicateStepError``).

The journal keys a step by its name within the run: before, a loop of
``runtime.step("send", send, x)`` silently skipped a repeated ``x`` (the first result was
replayed, in a fresh run) and logged a "replay divergence" for a new one, which under strict
replay was an error on the very first run. Now the second use of a name raises before its
body runs; a step that failed (nothing journaled) may be tried again under its name, and
idempotency keys, sub-runs and the next run of the session have their own names.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow.errors import DuplicateStepError, UserError
from loomflow.runtime import JournalRuntime

Factory = Callable[..., Awaitable[JournalRuntime]]


async def test_a_second_step_of_one_name_is_refused_before_it_runs(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()
    sent: list[int] = []

    async def send(x: int) -> int:
        sent.append(x)
        return x

    async with runtime.session("s", user_id="u") as run:
        assert await runtime.step("send", send, 1) == 1
        for x in (1, 2):  # the same arguments or others: the name is taken either way
            with pytest.raises(DuplicateStepError) as caught:
                await runtime.step("send", send, x)
            assert isinstance(caught.value, UserError)
            assert caught.value.step == "send"
            assert "'send_0', 'send_1'" in str(caught.value)
        assert await runtime.step("send_2", send, 2) == 2
    assert sent == [1, 2]
    assert (run.stats.misses, run.stats.hits, run.stats.divergences) == (2, 0, 0)
    # On resume each name replays once, and a second use is refused there too.
    async with runtime.session("s", user_id="u", resume=True, strict_replay=True) as again:
        assert await runtime.step("send", send, 1) == 1
        with pytest.raises(DuplicateStepError):
            await runtime.step("send", send, 1)
    assert (again.stats.hits, sent) == (1, [1, 2])


async def test_a_step_that_failed_may_be_tried_again_under_its_name(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()
    tries: list[int] = []

    async def flaky() -> str:
        tries.append(len(tries))
        if len(tries) < 3:
            raise ConnectionError("try again")
        return "charged"

    async def stream(n: int) -> Any:
        for i in range(n):
            yield i

    async with runtime.session("s", user_id="u"):
        for _ in range(3):  # a retry loop around one step
            try:
                assert await runtime.step("charge", flaky) == "charged"
                break
            except ConnectionError:
                continue
        # A stream closed before its end journals nothing: its name is free again.
        async with contextlib.aclosing(runtime.stream_step("tokens", stream, 3)) as chunks:
            async for _chunk in chunks:
                break
        assert [c async for c in runtime.stream_step("tokens", stream, 3)] == [0, 1, 2]
        with pytest.raises(DuplicateStepError):
            async for _chunk in runtime.stream_step("tokens", stream, 3):
                pass
    assert tries == [0, 1, 2]


async def test_other_keys_for_one_name_are_not_duplicates(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()

    async def echo(x: Any) -> Any:
        return x

    async with runtime.session("s", user_id="u"):
        # Idempotency keys are the whole journal key of their steps.
        for order in ("o-1", "o-2"):
            assert await runtime.step("charge", echo, order, idempotency_key=order) == order
        # Each sub-run (a tool call, a worker) has names of its own.
        for i in range(2):
            with runtime.subrun("worker"):
                assert await runtime.step("fetch", echo, i) == i
    async with runtime.session("s", user_id="u"):  # the session's next run
        assert await runtime.step("charge", echo, "o-3", idempotency_key="o-3") == "o-3"
        with runtime.subrun("worker"):
            assert await runtime.step("fetch", echo, 5) == 5


async def test_concurrent_steps_of_one_name_run_one_body(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    ran: list[int] = []

    async def slow(x: int) -> int:
        ran.append(x)
        await asyncio.sleep(0.01)
        return x

    async with runtime.session("s", user_id="u"):
        results = await asyncio.gather(
            runtime.step("fetch", slow, 1), runtime.step("fetch", slow, 2), return_exceptions=True
        )
    assert results[0] == 1
    assert isinstance(results[1], DuplicateStepError)
    assert ran == [1]
