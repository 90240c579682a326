"""A run opened inside another user's run is refused instead of journaling as theirs.

Inside an open run, ``runtime.session(...)`` (and so a sub-agent's run) becomes a sub-run of
the enclosing run. A sub-agent run with ``user_id="bob"`` inside alice's run used to journal
its steps under alice's scope, while its audit entries and budget named bob: bob's
idempotency keys were stored as alice's (a later step of alice with the same key got bob's
result, bob's own later step ran again), and ``users export`` / ``users forget`` of bob
missed them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow import Agent, ToolCall, tool
from loomflow.agent.architectures import Workflow
from loomflow.context import get_run_context
from loomflow.errors import ConfigurationError
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import JournalRuntime

Factory = Callable[..., Awaitable[JournalRuntime]]


async def test_a_session_of_another_user_inside_a_run_is_refused(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()
    ran: list[str] = []

    async def charge(order: str) -> str:
        ran.append(order)
        return f"charged {order}"

    with pytest.raises(ConfigurationError, match=r"user 'alice'.*user 'bob'"):
        async with runtime.session("s", "alice"), runtime.session("s", "bob"):
            await runtime.step("charge", charge, "A-1", idempotency_key="charge-A-1")
    assert ran == []
    assert await runtime.idempotency_results("alice") == []
    # The same user, or the user left out, is a sub-run of the enclosing run as before.
    async with runtime.session("s2", "alice"):
        async with runtime.session("s2", "alice"):
            await runtime.step("one", charge, "A-2")
        async with runtime.session("other"):
            await runtime.step("two", charge, "A-3")
    assert ran == ["A-2", "A-3"]
    # An anonymous run cannot host a named user's run either.
    with pytest.raises(ConfigurationError, match=r"run of the anonymous user .* user 'bob'"):
        async with runtime.session("s3"), runtime.session("s3", "bob"):
            pass


async def test_a_sub_agent_run_for_another_user_stops_the_run(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    charged: list[str | None] = []

    @tool
    async def charge(order: str) -> str:
        """Charge an order."""
        charged.append(get_run_context().user_id)
        return await runtime.step("charge", _ok, order, idempotency_key=f"charge-{order}")

    def child_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "charged"
        return [ToolCall(id="c", name="charge", arguments={"order": "A-1"})]

    child = Agent("child", model=FunctionModel(child_decides), tools=[charge], name="child")

    @tool
    async def for_bob(task: str) -> str:
        """Do the task for bob."""
        return (await child.run(task, user_id="bob")).output

    def parent_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return f"parent saw: {messages[-1].content}"
        return [ToolCall(id="d", name=tools[0].name, arguments={"task": "pay"})]

    parent = Agent("parent", model=FunctionModel(parent_decides), tools=[for_bob], runtime=runtime)
    # A mistake in the code: it stops the run instead of becoming a tool error for the model.
    with pytest.raises(ConfigurationError, match="user 'bob'"):
        await parent.run("go", session_id="s", user_id="alice")
    assert charged == []
    assert await runtime.idempotency_results("alice") == []
    assert await runtime.idempotency_results("bob") == []

    # A workflow run for bob inside alice's run is refused the same way.
    flow = Workflow([("child", child)])

    @tool
    async def flow_for_bob(task: str) -> str:
        """Run the flow for bob."""
        return (await flow.run(task, session_id="s", user_id="bob")).output

    parent = parent.clone(tools=[flow_for_bob])
    with pytest.raises(ConfigurationError, match="user 'bob'"):
        await parent.run("go", session_id="s2", user_id="alice")
    assert charged == []


async def _ok(order: str) -> str:
    return f"charged {order}"
