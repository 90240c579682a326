"""A misplaced Agent(...) argument is a UserError naming the parameter and the fix, at once.

These are the mistakes a first-time user makes while copying the README: one tool instead of
a list, a path instead of a runtime, a dict instead of Tuning, caps instead of a budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loomflow import Agent, Tuning, tool
from loomflow.errors import ConfigurationError, InvalidArgumentTypeError, UserError
from loomflow.governance import Cap, StandardBudget, StandardPermissions
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime


@tool
def lookup_order(order_id: str) -> str:
    """Look an order up."""
    return order_id


def plain(order_id: str) -> str:
    """A function that is not decorated."""
    return order_id


def _agent(**options: Any) -> Agent:
    return Agent("You help.", model=ScriptedModel(["hi"]), **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"tools": plain},
            "tools= takes a list of tools, not the single function 'plain': write tools=[plain]",
        ),
        ({"tools": lookup_order}, "not the single tool 'lookup_order': write tools=[lookup_order]"),
        ({"tools": None}, "tools= takes a list of tools, not None"),
        ({"tools": {"lookup_order": lookup_order}}, "not a dict: pass its values"),
        ({"tools": "lookup_order"}, "tools= takes a list of tools, not a str"),
        ({"guardrails": StandardPermissions()}, "guardrails= takes a list of guardrails"),
        ({"hooks": None}, "hooks= takes a list of RunHooks"),
        ({"runtime": "./journal.db"}, "runtime=SqliteRuntime('./journal.db')"),
        ({"runtime": Path("journal.db")}, "runtime=SqliteRuntime('journal.db')"),
        ({"runtime": "postgresql://app@db/app"}, "await PostgresRuntime.connect("),
        ({"runtime": object()}, "runtime= takes a SqliteRuntime, PostgresRuntime or InMemory"),
        ({"tuning": {"checkpoint": True}}, "tuning= takes a loomflow.Tuning(...), not a dict"),
        ({"budget": [Cap("cost_usd", 1.0)]}, "budget= takes a budget such as StandardBudget("),
        ({"budget": Cap("cost_usd", 1.0)}, "budget= takes a budget such as StandardBudget("),
        ({"permissions": "default"}, "permissions= takes a policy such as StandardPermissions"),
        ({"audit": "sqlite:///journal.db"}, "audit= takes an audit log such as AuditLog("),
        ({"telemetry": True}, "telemetry= takes a Telemetry(...)"),
        ({"max_turns": "3"}, "max_turns must be a whole number, not '3'"),
        ({"max_turns": 0}, "max_turns must be at least 1, not 0"),
    ],
)
def test_a_misplaced_argument_names_the_parameter_and_the_fix(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(UserError) as caught:
        _agent(**options)
    assert message in str(caught.value)
    if options.get("max_turns") != 0:  # a type mistake is also a TypeError, as it was before
        assert isinstance(caught.value, InvalidArgumentTypeError)
        assert isinstance(caught.value, TypeError)


def test_a_runtime_of_ones_own_that_has_what_the_protocol_lists_is_accepted() -> None:
    from loomflow.runtime import InMemoryRuntime

    class Forwarding:  # not a JournalRuntime: the documented seam is the Runtime protocol
        def __init__(self) -> None:
            self._inner = InMemoryRuntime()

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        backend = "forwarding"
        max_payload_bytes = None
        current_run = None

        async def step(self, *args: Any, **kwargs: Any) -> Any:
            return await self._inner.step(*args, **kwargs)

        def stream_step(self, *args: Any, **kwargs: Any) -> Any:
            return self._inner.stream_step(*args, **kwargs)

        def session(self, *args: Any, **kwargs: Any) -> Any:
            return self._inner.session(*args, **kwargs)

        def subrun(self, *args: Any, **kwargs: Any) -> Any:
            return self._inner.subrun(*args, **kwargs)

    _agent(runtime=Forwarding(), memory=False)


async def test_the_right_forms_still_build_and_run(tmp_path: Path) -> None:
    runtime = SqliteRuntime(tmp_path / "journal.db")
    agent = _agent(
        tools=(lookup_order, plain),  # any sequence; plain functions are wrapped
        guardrails=[],
        runtime=runtime,
        tuning=Tuning(checkpoint=True),
        budget=StandardBudget([Cap("tokens_total", 10_000)]),
        permissions=StandardPermissions(),
        telemetry=False,
        max_turns=3,
    )
    try:
        result = await agent.run("Hello", session_id="s-1", user_id="alice")
    finally:
        await runtime.close()
    assert result.output == "hi"
    assert sorted(agent.tools) == ["lookup_order", "plain"]
    assert sorted(agent.clone().tools) == ["lookup_order", "plain"]


@pytest.mark.parametrize("metadata", [["role"], "support", ("role", "support")])
async def test_run_metadata_that_is_not_a_mapping_is_refused_before_anything_runs(
    tmp_path: Path, metadata: Any
) -> None:
    runtime = SqliteRuntime(tmp_path / "journal.db")
    agent = _agent(runtime=runtime)
    try:
        with pytest.raises(InvalidArgumentTypeError, match="metadata must be a mapping"):
            await agent.run("Hello", session_id="s-1", user_id="alice", metadata=metadata)
        assert await runtime.sessions() == []  # nothing was journaled
        result = await agent.run("Hello", session_id="s-1", user_id="alice", metadata={"a": 1})
    finally:
        await runtime.close()
    assert result.output == "hi"


async def test_guardrails_and_hooks_given_as_generators_all_take_part() -> None:
    # The constructor stored tuple(guardrails) but built the loop's hooks from the argument
    # again, which a generator had already given up: the guardrail was listed on the agent
    # and never ran, so a card number went out unredacted.
    from loomflow.governance import PIIGuardrail
    from loomflow.hooks import RunHooks

    class Counting(RunHooks):
        def __init__(self) -> None:
            self.runs = 0

        async def run_started(self, info: Any) -> None:
            self.runs += 1

    counting = Counting()
    agent = Agent(
        "You help.",
        model=ScriptedModel(["Your card is 4111 1111 1111 1111"]),
        guardrails=(guard for guard in [PIIGuardrail()]),
        hooks=(hook for hook in [counting]),
        telemetry=False,
    )
    result = await agent.run("Which card?", session_id="s-1", user_id="alice")
    assert result.output == "Your card is [REDACTED:card]"
    assert len(agent.guardrails) == 1
    assert agent.hooks == (counting,)
    assert counting.runs == 1


@pytest.mark.parametrize(
    ("knobs", "named"),
    [
        ({"tool_timeout": -1}, "tool_timeout: Input should be greater than 0"),
        ({"temperature": 5}, "temperature: Input should be less than or equal to 2"),
        ({"timeout": 3}, "no knob 'timeout' (did you mean tool_timeout?)"),
        ({"max_turns": 3}, "max_turns is an argument of Agent(), not of Tuning"),
    ],
)
def test_a_bad_tuning_is_a_configuration_error_naming_the_knob(
    knobs: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Tuning(**knobs)
    assert named in str(caught.value)
    assert isinstance(caught.value, ValueError)  # what pydantic's error was: old handlers hold
