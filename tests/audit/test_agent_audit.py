"""What the agent loop writes to the audit log: runs, calls, replays, governance, divergences."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from loomflow.agent import Agent, Tuning
from loomflow.agent.hooks import Interrupt, RunHooks, RunInfo
from loomflow.audit import AuditLog, AuditRecord, InMemoryAuditStore, SqliteAuditStore, actions
from loomflow.errors import ReplayDivergenceError, RunCancelledError, StoreUnavailableError
from loomflow.governance import Rule, StandardPermissions
from loomflow.governance.events import (
    BudgetDenied,
    BudgetUnavailable,
    BudgetWarning,
    GuardrailTripped,
    PermissionDecided,
)
from loomflow.messages import Message, ModelSettings, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import InMemoryRuntime, SqliteRuntime
from loomflow.telemetry import Metrics, Telemetry
from loomflow.tools import Tool, ToolOutcome, tool


class Crash(BaseException):
    """Escapes the tool layer (which turns Exceptions into tool errors), like a dying worker."""


ran: list[str] = []
crash_once: list[bool] = []


@tool(sensitive=("card",))
def charge(card: str, amount: int) -> str:
    """Charge a card."""
    ran.append(f"charge {amount}")
    return f"charged {amount}"


@tool
def ship(order: str) -> str:
    """Ship an order."""
    if crash_once:
        crash_once.pop()
        raise Crash
    ran.append(f"ship {order}")
    return "shipped"


def plan(messages: list[Message], tools: list[ToolSpec]) -> Any:
    """Turn 0 charges, turn 1 ships, turn 2 answers."""
    done = sum(1 for m in messages if m.role == "tool")
    if done == 0:
        return [ToolCall(id="c0", name="charge", arguments={"card": "4111-0000", "amount": 7})]
    if done == 1:
        return [ToolCall(id="c1", name="ship", arguments={"order": "o-1"})]
    return "all done"


def acts(store: InMemoryAuditStore, run_id: str | None = None) -> list[str]:
    return [e.action for e in store.all_entries if run_id is None or e.run_id == run_id]


@pytest.fixture(autouse=True)
def _reset() -> None:
    ran.clear()
    crash_once.clear()


async def test_a_run_writes_its_calls_in_order_with_user_on_every_entry() -> None:
    store = InMemoryAuditStore()
    agent = Agent(
        "x",
        model=FunctionModel(plan),
        tools=[charge, ship],
        runtime=InMemoryRuntime(),
        audit=AuditLog(store),
    )
    result = await agent.run("buy", session_id="s", user_id="alice", metadata={"ticket": 7})
    assert acts(store) == [
        "run.start",
        "model.start",
        "model.call",
        "tool.call",
        "tool.result",
        "model.start",
        "model.call",
        "tool.call",
        "tool.result",
        "model.start",
        "model.call",
        "run.end",
    ]
    assert {(e.user_id, e.session_id, e.run_id) for e in store.all_entries} == {
        ("alice", "s", result.run_id)
    }
    start, model_start0, model0, call0, result0 = store.all_entries[:5]
    assert model_start0.payload["execution"] == model0.payload["execution"]
    assert model_start0.payload["step"] == "model_call_0"
    assert call0.payload["execution"] == result0.payload["execution"]
    assert call0.payload["step"] == result0.payload["step"]
    assert call0.payload["step"].startswith("tool_call_0_0_")
    assert start.payload["prompt"] == "buy"
    assert start.payload["metadata"] == {"ticket": 7}
    assert model0.payload["tool_calls"] == ["charge"]
    assert model0.payload["input_tokens"] > 0
    assert model0.payload["replayed"] is False
    assert call0.payload["arguments"] == {"card": "[REDACTED]", "amount": 7}
    assert call0.payload["executed"] is True
    assert result0.payload["ok"] is True
    assert result0.payload["result"] == "charged 7"
    end = store.all_entries[-1].payload
    assert end["outcome"] == "completed"
    assert (end["turns"], end["tokens_in"]) == (3, result.tokens_in)
    assert (await store.verify()).ok


async def test_a_resumed_run_records_replays_not_new_executions(tmp_path: Path) -> None:
    store = InMemoryAuditStore()
    runtime = SqliteRuntime(tmp_path / "journal.db")
    agent = Agent(
        "x", model=FunctionModel(plan), tools=[charge, ship], runtime=runtime, audit=AuditLog(store)
    )
    crash_once.append(True)
    with pytest.raises(Crash):
        await agent.run("buy", session_id="s", user_id="alice")
    first = store.all_entries[0].run_id
    # The ship that crashed inside its body began, and never finished: tool.call, no result.
    assert acts(store, first)[-3:] == ["model.call", "tool.call", "run.end"]
    assert store.all_entries[-1].payload["outcome"] == "failed"
    assert store.all_entries[-1].payload["error_type"] == "Crash"

    result = await agent.run("buy", session_id="s", user_id="alice")
    assert acts(store, result.run_id) == [
        "run.start",
        "model.replay",
        "tool.replay",
        "model.replay",
        "tool.call",
        "tool.result",
        "model.start",
        "model.call",
        "run.end",
    ]
    assert ran == ["charge 7", "ship o-1"]  # the charge did not run again
    replay = next(e for e in store.all_entries if e.action == "tool.replay")
    assert replay.payload["tool"] == "charge"
    assert replay.payload["arguments"]["card"] == "[REDACTED]"
    assert replay.payload["replayed"] is True
    model_replay = next(e for e in store.all_entries if e.action == "model.replay")
    assert model_replay.payload["billed"] is False
    assert store.all_entries[-1].payload["replayed_steps"] == 3
    assert (await store.verify(user_id="alice")).ok
    await runtime.close()


def _diverging_agent(
    store: InMemoryAuditStore, runtime: Any, instructions: str, **kw: Any
) -> Agent:
    return Agent(
        instructions,
        model=FunctionModel(plan),
        tools=[charge, ship],
        runtime=runtime,
        audit=AuditLog(store),
        **kw,
    )


async def test_a_replay_divergence_is_recorded_where_it_happened() -> None:
    store = InMemoryAuditStore()
    runtime = InMemoryRuntime()
    crash_once.append(True)
    with pytest.raises(Crash):
        await _diverging_agent(store, runtime, "v1").run("buy", session_id="s", user_id="bob")
    # Other instructions change model_call_0's inputs: it runs fresh, and the audit says so.
    result = await _diverging_agent(store, runtime, "v2").run("buy", session_id="s", user_id="bob")
    run = acts(store, result.run_id)
    # The journal reports a divergence once the step it diverged at has run.
    assert run[:4] == ["run.start", "model.start", "model.call", "replay.divergence"]
    divergence = next(e for e in store.all_entries if e.action == "replay.divergence")
    assert divergence.actor == "runtime"
    assert divergence.payload["step"] == "model_call_0"
    assert divergence.payload["kind"] == "model"
    assert divergence.user_id == "bob"


async def test_a_strict_divergence_is_recorded_before_the_failed_run_end() -> None:
    store = InMemoryAuditStore()
    runtime = InMemoryRuntime()
    crash_once.append(True)
    with pytest.raises(Crash):
        await _diverging_agent(store, runtime, "v1").run("buy", session_id="s", user_id="bob")
    strict = _diverging_agent(store, runtime, "v2", tuning=Tuning(strict_replay=True))
    with pytest.raises(ReplayDivergenceError):
        await strict.run("buy", session_id="s", user_id="bob")
    assert acts(store)[-3:] == ["run.start", "replay.divergence", "run.end"]
    assert store.all_entries[-1].payload["error_type"] == "ReplayDivergenceError"


class FakeGovernance(RunHooks):
    """Emits what the governance layer emits, at the points where it emits it."""

    def __init__(self, *, deny: str | None = None, budget_stop_at: int | None = None) -> None:
        self.deny = deny
        self.budget_stop_at = budget_stop_at

    async def before_model_call(
        self, info: RunInfo, turn: int, messages: list[Message], settings: ModelSettings
    ) -> Any:
        if turn == self.budget_stop_at:
            info.emit(BudgetDenied(cap="user.tokens_total", limit=100, used=90, requested=20))
            raise Interrupt("budget:user.tokens_total")
        info.emit(BudgetWarning(cap="user.tokens_total", limit=100, used=80, fraction=0.8))
        return None

    async def before_tool_call(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Tool[..., Any] | None
    ) -> ToolCall | ToolOutcome:
        denied = call.name == self.deny
        info.emit(
            PermissionDecided(
                tool=call.name,
                turn=turn,
                slot=slot,
                decision="ask" if denied else "allow",
                final="deny" if denied else "allow",
                reason="needs a human" if denied else "read-only",
                policy="finance",
                approver="carol" if denied else None,
                arguments={"card": "[REDACTED]"} if call.name == "charge" else {},
            )
        )
        if denied:
            return ToolOutcome(ok=False, error_type="permission_denied", error="carol said no")
        return call

    async def check_output(self, info: RunInfo, text: str) -> str:
        info.emit(GuardrailTripped(name="pii", stage="output", action="block", detail="email"))
        raise Interrupt("guardrail:pii")


async def test_governance_decisions_are_recorded_with_who_decided() -> None:
    store = InMemoryAuditStore()
    agent = Agent(
        "x",
        model=FunctionModel(plan),
        tools=[charge, ship],
        permissions=FakeGovernance(deny="charge"),
        audit=AuditLog(store),
    )
    result = await agent.run("buy", session_id="s", user_id="alice")
    assert result.interruption_reason == "guardrail:pii"
    assert ran == ["ship o-1"]
    names = acts(store)
    assert names[:6] == ["run.start", "budget.warning", "model.start", "model.call",
                         "permission.decision", "tool.call"]  # fmt: skip
    decision = store.all_entries[4]
    assert decision.actor == "approver:carol"
    assert decision.payload["decision"] == "ask"
    assert decision.payload["final"] == "deny"
    assert decision.payload["policy"] == "finance"
    denied_call, denied_result = store.all_entries[5], store.all_entries[6]
    assert denied_call.payload["executed"] is False
    assert denied_result.payload["error_type"] == "permission_denied"
    allowed = [e for e in store.all_entries if e.action == "permission.decision"][1]
    assert allowed.actor == "policy:finance"
    trip = next(e for e in store.all_entries if e.action == "guardrail.trip")
    assert trip.payload == {"guardrail": "pii", "stage": "output", "action": "block",
                            "detail": "email"}  # fmt: skip
    assert trip.actor == "guardrail:pii"
    assert names[-1] == "run.end"
    assert store.all_entries[-1].payload["interruption_reason"] == "guardrail:pii"
    assert store.all_entries[-1].payload["outcome"] == "interrupted"


async def test_a_budget_denial_is_recorded_before_the_interrupted_end() -> None:
    store = InMemoryAuditStore()
    agent = Agent(
        "x",
        model=FunctionModel(plan),
        tools=[charge, ship],
        budget=FakeGovernance(budget_stop_at=1),
        audit=AuditLog(store),
    )
    result = await agent.run("buy", session_id="s", user_id="alice")
    assert result.interruption_reason == "budget:user.tokens_total"
    assert acts(store)[-2:] == ["budget.denied", "run.end"]
    denied = store.all_entries[-2]
    assert denied.actor == "budget"
    assert denied.payload == {"cap": "user.tokens_total", "limit": 100, "used": 90,
                              "requested": 20}  # fmt: skip


class BudgetDown(RunHooks):
    async def before_model_call(
        self, info: RunInfo, turn: int, messages: list[Message], settings: ModelSettings
    ) -> Any:
        info.emit(BudgetUnavailable(detail="budget database unreachable"))
        raise Interrupt("budget:unavailable")


async def test_a_budget_outage_is_recorded() -> None:
    store = InMemoryAuditStore()
    agent = Agent("x", model=FunctionModel(plan), budget=BudgetDown(), audit=AuditLog(store))
    await agent.run("buy", session_id="s", user_id="alice")
    assert acts(store) == ["run.start", "budget.unavailable", "run.end"]
    assert store.all_entries[1].payload == {"detail": "budget database unreachable"}


class BrokenStore(InMemoryAuditStore):
    async def _append_chain(self, key: str, records: Any) -> Any:
        raise StoreUnavailableError("audit database is down")


async def test_an_audit_outage_fails_the_run_by_default() -> None:
    agent = Agent("x", model=FunctionModel(plan), tools=[charge], audit=AuditLog(BrokenStore()))
    with pytest.raises(StoreUnavailableError):
        await agent.run("buy", session_id="s", user_id="alice")
    assert ran == []  # nothing ran unrecorded


async def test_an_audit_outage_can_be_logged_instead(caplog: pytest.LogCaptureFixture) -> None:
    audit = AuditLog(BrokenStore(), on_error="log")
    agent = Agent("x", model=FunctionModel(plan), tools=[charge, ship], audit=audit)
    with caplog.at_level(logging.ERROR, logger="loomflow.audit"):
        result = await agent.run("buy", session_id="s", user_id="alice")
    assert result.output == "all done"
    assert "audit write" in caplog.text


async def test_manual_records_join_the_users_chain(tmp_path: Path) -> None:
    audit = AuditLog(SqliteAuditStore(tmp_path / "audit.db"))
    agent = Agent("x", model=FunctionModel(plan), tools=[charge, ship], audit=audit)
    await agent.run("buy", session_id="s", user_id="alice")
    entry = await audit.record(
        "approval.granted",
        user_id="alice",
        actor="approver:carol",
        payload={"ticket": "T-1", "password": "hunter22"},
    )
    assert entry.seq == 13  # 3 model.start, 3 model.call, 2 tool.call, 2 tool.result, 2 run
    assert entry.payload == {"ticket": "T-1", "password": "[REDACTED]"}
    page = await audit.query(user_id="alice", action="approval.*")
    assert [e.seq for e in page.entries] == [13]
    assert (await audit.verify()).ok
    await audit.close()


def test_actions_are_distinct_and_documented() -> None:
    assert len(set(actions.ALL)) == len(actions.ALL) == 20
    assert all(a.count(".") == 1 for a in actions.ALL)


async def test_records_are_validated() -> None:
    with pytest.raises(ValueError, match="actor"):
        AuditRecord(user_id="a", action="x")  # type: ignore[call-arg]


async def test_a_model_call_records_its_cache_tokens_apart() -> None:
    from loomflow.messages import ModelResponse, Usage
    from loomflow.models import ScriptedModel

    usage = Usage(input_tokens=1000, output_tokens=5, cache_read_tokens=800, cache_write_tokens=100)
    store = InMemoryAuditStore()
    cached = Agent(
        "x", model=ScriptedModel([ModelResponse(text="ok", usage=usage)]), audit=AuditLog(store)
    )
    await cached.run("hi", session_id="s-cache", user_id="alice")
    [call] = [e for e in store.all_entries if e.action == "model.call"]
    assert call.payload["input_tokens"] == 1000
    assert call.payload["cache_read_tokens"] == 800
    assert call.payload["cache_write_tokens"] == 100
    # A call without cache keeps the entry shape it always had.
    plain = Agent("x", model=ScriptedModel(["plain"]), audit=AuditLog(store))
    await plain.run("again", session_id="s-plain", user_id="alice")
    last = [e for e in store.all_entries if e.action == "model.call"][-1]
    assert "cache_read_tokens" not in last.payload
    assert "cache_write_tokens" not in last.payload
    assert (await store.verify()).ok


async def test_a_tool_name_the_model_made_up_is_audited_as_not_executed(tmp_path: Path) -> None:
    """Nothing begins for a tool that does not exist: its tool.call says executed=false, so
    `--action tool.call` with executed=true lists only the executions that really began."""

    def made_up(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if not any(m.role == "tool" for m in messages):
            args = {"x": 1, "sk-abcdefghijklmnopqrstuvwxyz0123": 2}
            return [ToolCall(id="c1", name="ghost_tool", arguments=args)]
        return "done"

    store = SqliteAuditStore(tmp_path / "audit.db")
    agent = Agent(
        "x",
        model=FunctionModel(made_up),
        tools=[ship],
        runtime=SqliteRuntime(tmp_path / "journal.db"),
        audit=AuditLog(store),
    )
    try:
        result = await agent.run("go", session_id="s", user_id="alice")
        assert "there is no tool named 'ghost_tool'" in result.messages[-2].content
        calls = (await store.query(user_id="alice", action=actions.TOOL_CALL)).entries
        results = (await store.query(user_id="alice", action=actions.TOOL_RESULT)).entries
        assert [c.payload["executed"] for c in calls] == [False]
        assert [r.payload["error_type"] for r in results] == ["unknown_tool"]
        assert calls[0].payload["execution"] == results[0].payload["execution"]
        # Its arguments are not the schema's: every value hidden, and a name shaped like a
        # secret redacted as any key is.
        assert calls[0].payload["arguments"] == {
            "x": "[REDACTED]",
            "[REDACTED:api_key]": "[REDACTED]",
        }
    finally:
        await agent.aclose()
        await store.close()


async def test_the_permission_decision_on_a_made_up_tool_hides_its_values_as_its_call_does() -> (
    None
):
    """A name the model made up has no schema, so no argument is known to be harmless: its
    tool.call hid every value, but the permission.decision just before it (a rule asking
    about every tool) showed them all."""
    from loomflow.models import ScriptedModel

    args = {"card_no": "4000-1234-secret-77", "memo": "for ana"}
    store = InMemoryAuditStore()
    agent = Agent(
        "x",
        model=ScriptedModel([[ToolCall(id="c1", name="charge_card", arguments=args)], "done"]),
        tools=[ship],
        permissions=StandardPermissions(rules=[Rule.ask("*")], approval="defer"),
        audit=AuditLog(store),
    )
    await agent.run("go", session_id="s", user_id="alice")
    shown = {
        e.action: e.payload["arguments"] for e in store.all_entries if "arguments" in e.payload
    }
    assert shown == {
        "permission.decision": {"card_no": "[REDACTED]", "memo": "[REDACTED]"},
        "tool.call": {"card_no": "[REDACTED]", "memo": "[REDACTED]"},
    }
    assert "secret-77" not in str([e.payload for e in store.all_entries])


async def test_a_db_password_argument_is_hidden_from_approvers_and_the_trail(
    tmp_path: Path,
) -> None:
    """A tool that declares nothing sensitive still gets its ``db_password`` hidden: the key's
    words name a secret (only a key spelt exactly ``password`` was hidden). The usage counts
    loomflow writes itself (``input_tokens``, ``tokens_in``) stay visible."""
    connected: list[str] = []

    @tool
    def connect(host: str, db_password: str) -> str:
        """Connect to a database."""
        connected.append(db_password)
        return "connected"

    from loomflow.models import ScriptedModel

    args = {"host": "db-1", "db_password": "hunter2-prod"}
    store = SqliteAuditStore(tmp_path / "audit.db")
    agent = Agent(
        "x",
        model=ScriptedModel([[ToolCall(id="c1", name="connect", arguments=args)], "done"]),
        tools=[connect],
        runtime=SqliteRuntime(tmp_path / "journal.db"),
        permissions=StandardPermissions(rules=[Rule.ask("connect")], approval="defer"),
        audit=AuditLog(store),
    )
    try:
        first = await agent.run("go", session_id="s", user_id="alice")
        (request,) = await agent.pending_approvals("s", user_id="alice")
        assert request.arguments == {"host": "db-1", "db_password": "[REDACTED]"}
        assert first.pending_approvals[0].arguments == request.arguments
        await agent.resume("go", session_id="s", user_id="alice",
                           approvals={request.request_id: "allow"})  # fmt: skip
        assert connected == ["hunter2-prod"]  # the tool itself gets the real value
        entries = (await store.query(user_id="alice")).entries
        assert "hunter2-prod" not in str([e.payload for e in entries])
        shown = {e.action: e.payload["arguments"] for e in entries if e.payload.get("arguments")}
        assert set(shown) == {"approval.request", "permission.decision", "tool.call"}
        assert all(a == request.arguments for a in shown.values())
        calls = [e.payload for e in entries if e.action == actions.MODEL_CALL]
        assert all(isinstance(c["input_tokens"], int) for c in calls)
        assert all(isinstance(c["output_tokens"], int) for c in calls)
        ends = [e.payload["tokens_in"] for e in entries if e.action == actions.RUN_END]
        assert ends
        assert all(isinstance(n, int) for n in ends)
    finally:
        await agent.aclose()
        await store.close()


gate: list[asyncio.Event] = []


@tool
async def wait_for_gate(order: str) -> str:
    """Wait until the test opens the gate."""
    started, release = gate
    started.set()
    await release.wait()
    return "waited"


def _waits(messages: list[Message], tools: list[ToolSpec]) -> Any:
    if not any(m.role == "tool" for m in messages):
        return [ToolCall(id="w0", name="wait_for_gate", arguments={"order": "o-1"})]
    return "done"


def _runs_counted(registry: CollectorRegistry, outcome: str) -> float:
    found = registry.get_sample_value(
        "loomflow_runs_total", {"backend": "sqlite", "outcome": outcome, "resumed": "false"}
    )
    return found or 0.0


@pytest.mark.parametrize("how", ["task", "runtime"])
async def test_a_cancelled_run_ends_cancelled_in_the_trail_as_in_the_metrics(
    tmp_path: Path, how: str
) -> None:
    # A run whose task was cancelled, or which someone cancelled (runtime.cancel): the
    # metrics count it as cancelled, and so does its run.end (it said "failed").
    store = SqliteAuditStore(tmp_path / "audit.db")
    runtime = SqliteRuntime(tmp_path / "journal.db")
    registry = CollectorRegistry()
    telemetry = Telemetry(metrics=Metrics(registry), tracing=False)
    agent = Agent("x", model=FunctionModel(_waits), tools=[wait_for_gate], runtime=runtime,
                  audit=AuditLog(store), telemetry=telemetry)  # fmt: skip
    gate[:] = [asyncio.Event(), asyncio.Event()]
    try:
        task = asyncio.create_task(agent.run("go", session_id="s", user_id="alice"))
        await asyncio.wait_for(gate[0].wait(), 10)
        if how == "task":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            error_type = "CancelledError"
        else:
            assert await runtime.cancel("s", user_id="alice")
            gate[1].set()
            with pytest.raises(RunCancelledError):
                await task
            error_type = "RunCancelledError"
        entries = (await store.query(user_id="alice")).entries
        end = entries[-1]
        assert end.action == actions.RUN_END
        assert end.payload["outcome"] == "cancelled"
        assert end.payload["error_type"] == error_type
        assert _runs_counted(registry, "cancelled") == 1
        assert _runs_counted(registry, "failed") == 0
        assert (await store.verify()).ok
    finally:
        gate.clear()
        await runtime.close()
        await store.close()


# -- sub-runs name the run they ran inside -------------------------------------------------


def _answers(text: str) -> FunctionModel:
    return FunctionModel(lambda messages, tools: text)


async def _starts(store: InMemoryAuditStore) -> dict[str, dict[str, Any]]:
    """The payload of each run.start entry, by the agent that wrote it."""
    page = await store.query(action=actions.RUN_START)
    return {e.payload["agent"]: {**e.payload, "run_id": e.run_id} for e in page.entries}


@pytest.mark.parametrize("architecture", ["team", "workflow", "debate", "tool"])
async def test_a_sub_run_names_its_parent_run_in_its_run_start(architecture: str) -> None:
    # Agents of a Team, Debate or Workflow, and an agent run from a tool, audited under their
    # own run ids with nothing leading back to the run they were part of.
    from loomflow.agent.architectures import Debate, Team, Workflow

    store = InMemoryAuditStore()
    audit = AuditLog(store)

    def agent(name: str, model: FunctionModel, **options: Any) -> Agent:
        return Agent(name, model=model, name=name, audit=audit, **options)

    result: Any
    if architecture in ("team", "tool"):

        def lead_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
            if not any(m.role == "tool" for m in messages):
                return [ToolCall(id="t0", name="ask_w", arguments={"task": "sum"})]
            return "done"

        worker = agent("w", _answers("42"))
        if architecture == "team":
            result = await Team(agent("lead", FunctionModel(lead_decides)), [worker]).run(
                "go", user_id="u"
            )
        else:

            @tool
            async def ask_w(task: str) -> str:
                """Ask the worker."""
                return (await worker.run(task)).output

            result = await agent("lead", FunctionModel(lead_decides), tools=[ask_w]).run(
                "go", user_id="u"
            )
        starts = await _starts(store)
        assert set(starts) == {"lead", "w"}
        assert "parent_run_id" not in starts["lead"]  # a run of its own
        assert starts["lead"]["run_id"] == result.run_id
        assert starts["w"]["parent_run_id"] == result.run_id != starts["w"]["run_id"]
        return
    if architecture == "workflow":
        result = await Workflow(
            [("a", agent("a", _answers("1"))), ("b", agent("b", _answers("2")))]
        ).run("go", user_id="u")
        names = {"a", "b"}
    else:
        result = await Debate(
            [agent("pro", _answers("yes"))], agent("judge", _answers("yes")), rounds=1
        ).run("go", user_id="u")
        names = {"pro", "judge"}
    starts = await _starts(store)
    assert set(starts) == names
    for payload in starts.values():
        assert payload["parent_run_id"] == result.run_id != payload["run_id"]
