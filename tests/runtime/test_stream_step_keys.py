"""``stream_step`` refuses an idempotency key instead of handing it to the function.

``step()`` takes ``idempotency_key=`` as the journal key; ``stream_step()`` has none and
passed it on to ``fn`` as one more keyword argument: a function taking ``**kwargs`` ran
again in every run that reached it, although its caller had asked for it to run once.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from loomflow.errors import UserError
from loomflow.runtime import JournalRuntime

Factory = Callable[..., Awaitable[JournalRuntime]]


async def test_stream_step_refuses_an_idempotency_key(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    calls: list[dict[str, Any]] = []

    async def chunks(n: int, **options: Any) -> AsyncIterator[int]:
        calls.append(options)
        for i in range(n):
            yield i

    async with runtime.session("s", "u"):
        with pytest.raises(UserError, match=r"stream_step\('tokens'\) takes no idempotency_key"):
            async for _ in runtime.stream_step("tokens", chunks, 2, idempotency_key="k"):
                pass
        assert calls == []
        # Refused before the step took its name: the call can be made right, under it.
        keyed = functools.partial(chunks, idempotency_key="k")  # for a fn that takes one
        assert [c async for c in runtime.stream_step("tokens", keyed, 2)] == [0, 1]
    assert calls == [{"idempotency_key": "k"}]
