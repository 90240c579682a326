"""Steps with one idempotency key started together run once, in one process.

Both used to find no stored result and both ran their function (a payment taken twice);
only the result stored first was handed to both. A second step with the key now waits for
the first and replays what it stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from loomflow import Agent, ToolCall, tool
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import JournalRuntime

Factory = Callable[..., Awaitable[JournalRuntime]]


class Payments:
    def __init__(self) -> None:
        self.taken: list[tuple[str, int]] = []
        self.fail_next = False

    async def charge(self, order: str, cents: int) -> str:
        self.taken.append((order, cents))
        number = len(self.taken)
        await asyncio.sleep(0.05)  # the other step starts meanwhile
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("provider down")
        return f"receipt {number} for {order}"


async def test_two_steps_with_one_key_in_one_run_charge_once(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    pay = Payments()
    async with runtime.session("s", "ana"):
        first, second = await asyncio.gather(
            runtime.step("charge_a", pay.charge, "A-1", 500, idempotency_key="charge-A-1"),
            runtime.step("charge_b", pay.charge, "A-1", 500, idempotency_key="charge-A-1"),
        )
    assert pay.taken == [("A-1", 500)]
    assert first == second == "receipt 1 for A-1"
    assert runtime._key_locks == {}  # keys are unbounded: no idle lock stays behind


async def test_two_sessions_of_a_user_charge_once_and_users_stay_apart(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()
    pay = Payments()

    async def order(session: str, user: str) -> str:
        async with runtime.session(session, user):
            result = await runtime.step("charge", pay.charge, "A-2", 900, idempotency_key="k")
            return str(result)

    results = await asyncio.gather(order("s1", "ana"), order("s2", "ana"), order("s3", "bob"))
    # Ana's two sessions share her key; Bob's key of the same text is his own.
    assert sorted(pay.taken) == [("A-2", 900), ("A-2", 900)]
    assert results[0] == results[1]
    assert results[2] != results[0]


async def test_a_failed_holder_lets_the_waiting_step_run(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    pay = Payments()
    pay.fail_next = True
    async with runtime.session("s", "ana"):
        outcomes = await asyncio.gather(
            runtime.step("one", pay.charge, "A-3", 100, idempotency_key="charge-A-3"),
            runtime.step("two", pay.charge, "A-3", 100, idempotency_key="charge-A-3"),
            return_exceptions=True,
        )
    assert isinstance(outcomes[0], ConnectionError)
    assert outcomes[1] == "receipt 2 for A-3"
    assert len(pay.taken) == 2


async def test_a_step_inside_a_step_with_the_same_key_does_not_wait_for_itself(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()

    async def inner() -> str:
        return "inner"

    async def outer() -> str:
        return str(await runtime.step("inner", inner, idempotency_key="k")) + "+outer"

    async with runtime.session("s", "ana"):
        result = await asyncio.wait_for(
            runtime.step("outer", outer, idempotency_key="k"), timeout=10
        )
    # As before: the inner step stored its result under the key first, the outer one's
    # write found it there and kept it.
    assert result == "inner"


async def test_parallel_tool_calls_asking_for_one_payment_twice_charge_once(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()
    pay = Payments()

    @tool
    async def charge(order: str, cents: int) -> str:
        """Charge an order."""
        return str(
            await runtime.step("charge", pay.charge, order, cents, idempotency_key=f"pay-{order}")
        )

    def decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return " / ".join(m.content for m in messages if m.role == "tool")
        # Models do repeat a call within one answer.
        call = {"order": "A-4", "cents": 700}
        return [
            ToolCall(id="a", name="charge", arguments=call),
            ToolCall(id="b", name="charge", arguments=call),
        ]

    agent = Agent("pay", model=FunctionModel(decides), tools=[charge], runtime=runtime)
    result = await agent.run("pay A-4", session_id="s", user_id="ana")
    assert pay.taken == [("A-4", 700)]
    assert result.output == "receipt 1 for A-4 / receipt 1 for A-4"
