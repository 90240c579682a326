"""What deciding does to a stopped run's state, cancelling a run that waits, and redaction of
edited sensitive arguments; on the three journals (memory, SQLite file, PostgreSQL database).

A decision journaled without resuming (the command line's ``approve``, or a crash between
deciding and resuming) must leave the run ``interrupted``; a cancelled run must never run the
tool it waited for.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow.agent import Agent
from loomflow.agent._approvals import audit_decision
from loomflow.audit import AuditLog, InMemoryAuditStore, actions
from loomflow.errors import ApprovalArgumentsError, RunCancelledError, StoreUnavailableError
from loomflow.governance import Approve, Deny, StandardPermissions
from loomflow.governance.approvals import journal_decisions, normalize_decision
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.recovery import cancel_run
from loomflow.runtime import JournalRuntime
from loomflow.tools import Tool

Factory = Callable[..., Awaitable[JournalRuntime]]

TRANSFER = ToolCall(id="c1", name="transfer", arguments={"account": "A-1", "pin": "1234"})


class Bank:
    """One destructive tool whose ``pin`` is sensitive; counts what really ran."""

    def __init__(self) -> None:
        self.transfers: list[dict[str, Any]] = []

    def agent(self, runtime: JournalRuntime, audit: AuditLog | None = None) -> Agent:
        def transfer(account: str, pin: str = "") -> str:
            """Move the money."""
            self.transfers.append({"account": account, "pin": pin})
            return f"moved from {account}"

        def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
            if not [m for m in messages if m.role == "tool"]:
                return [TRANSFER]
            return "done"

        return Agent(
            "bank",
            model=FunctionModel(decide),
            tools=[Tool(transfer, destructive=True, sensitive={"pin"}, edits=True)],
            runtime=runtime,
            permissions=StandardPermissions(approval="defer"),
            memory=False,
            audit=audit,
        )


async def _state(runtime: JournalRuntime, session_id: str = "s1") -> str:
    [info] = await runtime.sessions(session_id=session_id)
    return info.state


async def test_a_decision_alone_leaves_the_run_interrupted(runtime_factory: Factory) -> None:
    bank = Bank()
    runtime = await runtime_factory()
    agent = bank.agent(runtime)
    (request,) = (await agent.run("pay", session_id="s1", user_id="ana")).pending_approvals
    assert await _state(runtime) == "interrupted"

    # Another process journals the decision without resuming (the CLI's approve).
    other = await runtime_factory()
    decision = normalize_decision(request.request_id, Approve(), "kim")
    await journal_decisions(other, "s1", "ana", {request.request_id: decision})
    assert await _state(other) == "interrupted"  # not "finished": nothing has continued
    assert [s.state for s in await other.sessions(state="interrupted")] == ["interrupted"]
    assert await other.sessions(state="finished") == []
    assert await agent.pending_approvals("s1", user_id="ana") == []
    assert bank.transfers == []

    # The application's next resume applies it and the run finishes.
    result = await agent.resume("pay", session_id="s1", user_id="ana")
    assert not result.interrupted
    assert await _state(runtime) == "finished"


async def test_a_run_waiting_for_approval_can_be_cancelled(runtime_factory: Factory) -> None:
    bank = Bank()
    runtime = await runtime_factory()
    audit = AuditLog(InMemoryAuditStore())
    agent = bank.agent(runtime, audit)
    (request,) = (await agent.run("pay", session_id="s1", user_id="ana")).pending_approvals

    other = await runtime_factory()
    assert await cancel_run(other, "s1", user_id="ana", audit=audit, actor="cli:ops") is True
    assert await _state(other) == "cancelled"
    assert await cancel_run(other, "s1", user_id="ana", audit=audit) is False  # once
    cancels = (await audit.query(user_id="ana", action=actions.RUN_CANCEL)).entries
    assert [(e.actor, e.session_id) for e in cancels] == [("cli:ops", "s1")]
    # Nothing waits any more, and no decision can be recorded or applied.
    assert await agent.pending_approvals("s1", user_id="ana") == []
    with pytest.raises(RunCancelledError, match="cancelled"):
        await agent.resume(
            "pay", session_id="s1", user_id="ana", approvals={request.request_id: "allow"}
        )
    decision = normalize_decision(request.request_id, Approve(), "kim")
    with pytest.raises(RunCancelledError):
        await journal_decisions(other, "s1", "ana", {request.request_id: decision})
    with pytest.raises(RunCancelledError):
        await agent.resume("pay", session_id="s1", user_id="ana")
    assert bank.transfers == []
    assert not (await audit.query(user_id="ana", action=actions.APPROVAL_DECISION)).entries
    assert await _state(other) == "cancelled"

    # A new run of the session starts afresh.
    again = await agent.run("pay", session_id="s1", user_id="ana")
    assert again.interruption_reason == "approval"
    assert await _state(runtime) == "interrupted"


async def test_a_decided_run_cancelled_before_its_resume_does_not_run_the_tool(
    runtime_factory: Factory,
) -> None:
    bank = Bank()
    runtime = await runtime_factory()
    agent = bank.agent(runtime)
    (request,) = (await agent.run("pay", session_id="s1", user_id="ana")).pending_approvals
    decision = normalize_decision(request.request_id, Approve(), "kim")
    await journal_decisions(runtime, "s1", "ana", {request.request_id: decision})
    assert await runtime.cancel("s1", "ana") is True
    with pytest.raises(RunCancelledError):
        await agent.resume("pay", session_id="s1", user_id="ana")
    assert bank.transfers == []


async def test_finished_runs_stay_not_cancellable(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    async with runtime.session("s1", "ana"):
        pass
    assert await _state(runtime) == "finished"
    assert await runtime.cancel("s1", "ana") is False
    assert await _state(runtime) == "finished"


async def test_edited_sensitive_arguments_are_redacted_in_the_audit_log(
    runtime_factory: Factory,
) -> None:
    bank = Bank()
    runtime = await runtime_factory()
    audit = AuditLog(InMemoryAuditStore())
    agent = bank.agent(runtime, audit)
    (request,) = (await agent.run("pay", session_id="s1", user_id="ana")).pending_approvals
    # The request carries the names the tool declares sensitive, for whoever decides later.
    assert request.sensitive == ["pin"]
    assert request.arguments == {"account": "A-1", "pin": "[REDACTED]"}

    # The command line's path: no agent, so no tool; the request's names are enough.
    # Pins of ten digits: four could turn up by chance in the payloads' random request ids
    # (hex) or a timestamp's microseconds.
    edited = normalize_decision(
        request.request_id, Approve(arguments={"account": "A-2", "pin": "9876543210"}), "kim"
    )
    other = await runtime_factory()
    decided = await journal_decisions(other, "s1", "ana", {request.request_id: edited})
    await audit_decision(
        audit, decided[request.request_id], edited, None, session_id="s1", user_id="ana"
    )
    [entry] = (await audit.query(user_id="ana", action=actions.APPROVAL_DECISION)).entries
    assert entry.payload["arguments"] == {"account": "A-2", "pin": "[REDACTED]"}
    assert "9876543210" not in str(entry.payload)

    # The agent's path redacts the same way.
    (second,) = (await agent.run("pay", session_id="s2", user_id="ana")).pending_approvals
    await agent.resume(
        "pay",
        session_id="s2",
        user_id="ana",
        approvals={second.request_id: Approve(arguments={"account": "A-3", "pin": "5555012345"})},
        decided_by="kim",
    )
    entries = (await audit.query(user_id="ana", limit=100)).entries
    assert "9876543210" not in str([e.payload for e in entries])
    assert "5555012345" not in str([e.payload for e in entries])


async def test_a_sealed_argument_reaches_the_tool_when_the_same_agent_resumes(
    runtime_factory: Factory,
) -> None:
    # The server pattern: the request handler that got "pending" and the approval endpoint
    # that resumes run in one process with one agent, which still holds the sealed value.
    bank = Bank()
    runtime = await runtime_factory()
    agent = bank.agent(runtime)
    (request,) = (await agent.run("pay", session_id="s1", user_id="ana")).pending_approvals
    result = await agent.resume(
        "pay", session_id="s1", user_id="ana", approvals={request.request_id: Approve()}
    )
    assert result.output == "done"
    assert bank.transfers == [{"account": "A-1", "pin": "1234"}]

    # Another agent object (as after a restart) never had the value: the tool does not run
    # with a placeholder; the model is told the value is gone.
    (again,) = (await agent.run("pay", session_id="s2", user_id="ana")).pending_approvals
    fresh = bank.agent(await runtime_factory())
    await fresh.resume(
        "pay", session_id="s2", user_id="ana", approvals={again.request_id: Approve()}
    )
    assert bank.transfers == [{"account": "A-1", "pin": "1234"}]


async def test_a_decision_the_audit_log_cannot_record_is_not_journaled(
    runtime_factory: Factory,
) -> None:
    """resume(approvals=...) audits each decision before journaling it: with the audit store
    down nothing is decided, and the retry (audit back) records it once."""
    bank = Bank()
    runtime = await runtime_factory()
    audit = AuditLog(InMemoryAuditStore())
    agent = bank.agent(runtime, audit)
    (request,) = (await agent.run("pay", session_id="s1", user_id="ana")).pending_approvals

    # The approval endpoint's audit database does not answer (nothing listens on port 1).
    down = bank.agent(runtime, AuditLog("postgresql://loomflow@127.0.0.1:1/audit"))
    with pytest.raises(StoreUnavailableError):
        await down.resume(
            "pay", session_id="s1", user_id="ana", approvals={request.request_id: Approve()},
            decided_by="kim",
        )  # fmt: skip
    assert await agent.pending_approvals("s1", user_id="ana") == [request]
    assert bank.transfers == []

    result = await agent.resume(
        "pay", session_id="s1", user_id="ana", approvals={request.request_id: Approve()},
        decided_by="kim",
    )  # fmt: skip
    assert not result.interrupted
    assert [t["account"] for t in bank.transfers] == ["A-1"]
    decisions = (await audit.query(user_id="ana", action=actions.APPROVAL_DECISION)).entries
    assert [(e.actor, e.payload["request_id"]) for e in decisions] == [
        ("approver:kim", request.request_id)
    ]


async def _stopped_elsewhere(bank: Bank, runtime_factory: Factory) -> tuple[Agent, str]:
    """A run stopped at the transfer; the agent that resumes it is another one (another
    worker, an approval endpoint), which does not hold the sealed ``pin``."""
    runtime = await runtime_factory()
    stopped = await bank.agent(runtime).run("pay", session_id="s1", user_id="ana")
    (request,) = stopped.pending_approvals
    return bank.agent(await runtime_factory(), AuditLog(InMemoryAuditStore())), request.request_id


def _tool_results(result: Any) -> list[str]:
    return [m.content for m in result.messages if m.role == "tool"]


async def test_an_edit_that_gives_every_value_runs_where_the_sealed_ones_are_gone(
    runtime_factory: Factory,
) -> None:
    bank = Bank()
    endpoint, request_id = await _stopped_elsewhere(bank, runtime_factory)
    edit = Approve(arguments={"account": "A-2", "pin": "9999012345"})
    result = await endpoint.resume(
        "pay", session_id="s1", user_id="ana", approvals={request_id: edit}, decided_by="kim"
    )
    assert bank.transfers == [{"account": "A-2", "pin": "9999012345"}]
    assert _tool_results(result) == ["moved from A-2"]
    assert endpoint.audit is not None
    decided = await endpoint.audit.query(user_id="ana", action=actions.PERMISSION_DECISION)
    [entry] = decided.entries
    assert entry.payload["final"] == "allow"
    assert entry.payload["edited"] is True
    assert "9999012345" not in json.dumps(entry.payload)  # the edited pin is still redacted


async def test_a_denial_reaches_the_model_where_the_sealed_values_are_gone(
    runtime_factory: Factory,
) -> None:
    bank = Bank()
    endpoint, request_id = await _stopped_elsewhere(bank, runtime_factory)
    result = await endpoint.resume(
        "pay", session_id="s1", user_id="ana", approvals={request_id: Deny("blocked by fraud")},
        decided_by="kim",
    )  # fmt: skip
    assert bank.transfers == []
    [told] = _tool_results(result)
    assert "permission denied" in told
    assert "blocked by fraud" in told
    assert "sealed" not in told  # not "call the tool again with the same arguments"


async def test_an_approval_without_edits_cannot_run_where_the_sealed_values_are_gone(
    runtime_factory: Factory,
) -> None:
    bank = Bank()
    endpoint, request_id = await _stopped_elsewhere(bank, runtime_factory)
    result = await endpoint.resume(
        "pay", session_id="s1", user_id="ana", approvals={request_id: Approve()}, decided_by="kim"
    )
    assert bank.transfers == []  # never with a placeholder for the pin
    [told] = _tool_results(result)
    assert "was sealed" in told


async def test_a_resume_elsewhere_without_a_decision_keeps_the_call_waiting(
    runtime_factory: Factory,
) -> None:
    bank = Bank()
    endpoint, request_id = await _stopped_elsewhere(bank, runtime_factory)
    again = await endpoint.resume("pay", session_id="s1", user_id="ana")
    assert again.interruption_reason == "approval"
    assert [r.request_id for r in again.pending_approvals] == [request_id]
    assert bank.transfers == []


async def test_an_edit_that_keeps_a_redacted_placeholder_is_refused(
    runtime_factory: Factory,
) -> None:
    # The request shows a sensitive value as "[REDACTED]"; an edit made by copying the
    # request's arguments and changing another value ran the tool with the placeholder as
    # the PIN, even in the process that still held the model's value.
    bank = Bank()
    runtime = await runtime_factory()
    audit = AuditLog(InMemoryAuditStore())
    agent = bank.agent(runtime, audit)
    (request,) = (await agent.run("pay", session_id="s1", user_id="ana")).pending_approvals
    copied = {**request.arguments, "account": "A-2"}
    with pytest.raises(ApprovalArgumentsError, match=r"'pin'.*\[REDACTED\]") as caught:
        await agent.resume(
            "pay",
            session_id="s1",
            user_id="ana",
            approvals={request.request_id: Approve(arguments=copied)},
            decided_by="kim",
        )
    assert caught.value.request_id == request.request_id
    # Nothing recorded (the same call journals nothing, as for a schema mismatch): the
    # request still waits, no decision is audited, and the journal-only path refuses too.
    assert (await audit.query(user_id="ana", action=actions.APPROVAL_DECISION)).entries == []
    decision = normalize_decision(request.request_id, Approve(arguments=copied), "kim")
    with pytest.raises(ApprovalArgumentsError):
        await journal_decisions(
            await runtime_factory(), "s1", "ana", {request.request_id: decision}
        )
    assert [p.request_id for p in await agent.pending_approvals("s1", user_id="ana")] == [
        request.request_id
    ]
    # The value given, it runs with it.
    given = {**copied, "pin": "9876"}
    result = await agent.resume(
        "pay",
        session_id="s1",
        user_id="ana",
        approvals={request.request_id: Approve(arguments=given)},
        decided_by="kim",
    )
    assert result.output == "done"
    assert bank.transfers == [{"account": "A-2", "pin": "9876"}]


async def test_a_secret_in_an_edit_is_redacted_in_the_permission_event(
    runtime_factory: Factory,
) -> None:
    """The model's secrets reach the ``PermissionDecided`` event sealed; an edit's are read
    back from the journal, unsealed, and the event (what ``on_event`` hooks and the
    application see) carried an API key given in an edit in clear."""
    from loomflow.governance import PermissionDecided
    from loomflow.hooks import RunHooks, RunInfo

    key = "sk-ant-api03-" + "q" * 40
    seen: list[PermissionDecided] = []

    class Events(RunHooks):
        async def on_event(self, info: RunInfo, event: Any) -> None:
            if isinstance(event, PermissionDecided):
                seen.append(event)

    bank = Bank()
    agent = bank.agent(await runtime_factory()).clone(guardrails=[Events()])
    (request,) = (await agent.run("pay", session_id="s1", user_id="ana")).pending_approvals
    await agent.resume(
        "pay",
        session_id="s1",
        user_id="ana",
        approvals={request.request_id: Approve(arguments={"account": f"A-2 {key}", "pin": "1"})},
    )
    (event,) = seen
    assert event.edited
    assert key not in event.model_dump_json()
    assert event.arguments["pin"] == "[REDACTED]"
    assert bank.transfers == [{"account": f"A-2 {key}", "pin": "1"}]  # the tool got it all
