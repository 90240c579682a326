"""User ids hidden by ``user_ids="hashed"``/``"omit"`` stay hidden in the error text of spans.

loomflow's own errors name the session's user (``session 's1' of user 'alice' ...``), and a
span's status description and ``exception`` event are exported whatever the option says.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.trace import StatusCode

from loomflow.agent import Agent
from loomflow.errors import OwnershipLostError
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime
from loomflow.telemetry import Telemetry
from loomflow.telemetry.testing import SpanCapture
from loomflow.tools import tool

pytestmark = pytest.mark.timeout(120)

USER = "alice-7781"
KEY = "k" * 32
# The hash of USER as docs/telemetry.md describes it: what a trace search would look for.
HASHED = "h:" + hmac.new(KEY.encode(), USER.encode(), hashlib.sha256).hexdigest()[:16]


def _exported_text(capture: SpanCapture) -> str:
    return json.dumps(
        [
            {
                "attributes": dict(s.attributes or {}),
                "status": s.status.description,
                "events": [dict(e.attributes or {}) for e in s.events],
            }
            for s in capture.spans
        ],
        default=str,
    )


@pytest.mark.parametrize(
    ("mode", "shown"),
    [("omit", "[user]"), ("hashed", HASHED)],
)
async def test_a_lost_lease_error_on_spans_does_not_name_a_hidden_user(
    tmp_path: Path, mode: str, shown: str
) -> None:
    path = tmp_path / "journal.db"

    def take_over() -> None:
        # Another worker (own runtime, own loop) takes the session once the lease ran out.
        async def other() -> None:
            runtime = SqliteRuntime(path, turn_timeout=10)
            try:
                async with runtime.session("s1", USER, resume=True):
                    await runtime.step("other", lambda: "B")
            finally:
                await runtime.close()

        def main() -> None:
            time.sleep(0.8)
            asyncio.run(other())

        thread = threading.Thread(target=main)
        thread.start()
        thread.join(30)  # blocks this loop too: the heartbeat cannot renew the lease

    @tool
    async def stall() -> str:
        """Stall the whole process past its lease."""
        take_over()
        return "ok"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "done"
        return [ToolCall(id="c1", name="stall", arguments={})]

    capture = SpanCapture()
    runtime = SqliteRuntime(path, lease_seconds=0.5, turn_timeout=10)
    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[stall],
        runtime=runtime,
        telemetry=Telemetry(
            tracer_provider=capture.provider,
            metrics=False,
            user_ids=mode,  # type: ignore[arg-type]
            user_id_key=KEY if mode == "hashed" else None,
        ),
        name="a",
    )
    try:
        with pytest.raises(OwnershipLostError, match=USER):  # the caller still learns who
            await agent.run("q", session_id="s1", user_id=USER)
    finally:
        await runtime.close()

    [root] = capture.named("invoke_agent a")
    # An error span (this invocation raised to its caller), told apart by its outcome.
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes is not None
    assert root.attributes["loom.run.outcome"] == "claim_lost"
    assert root.attributes["error.type"] == "OwnershipLostError"
    description = root.status.description or ""
    assert "now belongs to a newer run" in description
    text = _exported_text(capture)
    assert USER not in text
    assert f"of user '{shown}'" in description


def test_short_ids_are_hidden_where_quoted_only() -> None:
    telemetry = Telemetry(user_ids="omit", metrics=False)
    hide = telemetry._user_ids.hide("7")
    assert hide is not None
    assert hide("session 's' of user '7' at line 71") == "session 's' of user '[user]' at line 71"
    assert Telemetry(user_ids="plain", metrics=False)._user_ids.hide("7") is None
    # An id that the placeholder contains is replaced once, not inside the placeholder again.
    hide = telemetry._user_ids.hide("user")
    assert hide is not None
    assert hide("of user 'user'") == "of [user] '[user]'"


@pytest.mark.parametrize(
    ("mode", "shown"), [("omit", "[user]"), ("hashed", HASHED), ("plain", USER)]
)
async def test_a_users_own_permission_policy_is_named_as_the_option_says(
    mode: str, shown: str
) -> None:
    """``loom.permission.policy`` named a per-user policy ``user:<id>`` in plain."""
    from loomflow.governance import Policy, Rule, StandardPermissions

    @tool
    def lookup(order: int) -> str:
        """Look an order up."""
        return "shipped"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "done"
        return [ToolCall(id="c1", name="lookup", arguments={"order": 7})]

    capture = SpanCapture()
    telemetry = Telemetry(
        tracer_provider=capture.provider,
        metrics=False,
        user_ids=mode,  # type: ignore[arg-type]
        user_id_key=KEY if mode == "hashed" else None,
    )
    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[lookup],
        permissions=StandardPermissions(
            users={USER: Policy([Rule.deny("lookup", reason=f"not for {USER!r}")])}
        ),
        telemetry=telemetry,
        name="a",
    )
    await agent.run("q", session_id="s1", user_id=USER)

    [root] = capture.named("invoke_agent a")
    [event] = [e for e in root.events if e.name == "loom.permission.decided"]
    attributes = dict(event.attributes or {})
    assert attributes["loom.permission.policy"] == f"user:{shown}"
    assert attributes["loom.permission.reason"] == f"not for {shown!r}"
    if mode != "plain":
        assert USER not in _exported_text(capture)


async def test_a_tool_error_naming_the_user_is_hidden_on_its_span() -> None:
    from loomflow.context import get_run_context

    @tool
    def lookup(order: int) -> str:
        """Look an order up."""
        raise PermissionError(f"user {get_run_context().user_id!r} may not see order {order}")

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "done"
        return [ToolCall(id="c1", name="lookup", arguments={"order": 7})]

    capture = SpanCapture()
    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[lookup],
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=False, user_ids="omit"),
        name="a",
    )
    await agent.run("q", session_id="s1", user_id=USER)

    [span] = capture.named("execute_tool lookup")
    assert "user '[user]' may not see order 7" in (span.status.description or "")
    assert USER not in _exported_text(capture)
