"""Deferred approvals: the run stops at a call that needs a person, and resumes once decided.

Every test runs on the three journals (memory, SQLite file, PostgreSQL database); a second
runtime object over the same journal plays the other process (the crash test in
``test_approvals_processes.py`` uses real ones).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow.agent import Agent
from loomflow.audit import AuditLog, InMemoryAuditStore, actions
from loomflow.errors import (
    ApprovalArgumentsError,
    ApprovalDecidedError,
    ApprovalNotFoundError,
    InvalidArgumentTypeError,
    InvalidIdError,
    UserError,
)
from loomflow.governance import (
    PERMISSION_DENIED,
    Approve,
    Cap,
    Deny,
    InMemoryBudgetStore,
    PendingApproval,
    Rule,
    StandardBudget,
    StandardPermissions,
)
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import JournalRuntime
from loomflow.tools import Tool

Factory = Callable[..., Awaitable[JournalRuntime]]


class World:
    """The side effects the tools had, so a test can count them."""

    def __init__(self) -> None:
        self.deleted: list[str] = []
        self.read: list[str] = []
        self.model_calls = 0

    def tools(self) -> list[Tool[..., Any]]:
        def delete_record(name: str, reason: str = "") -> str:
            """Delete a record."""
            self.deleted.append(name)
            return f"deleted {name}"

        def read_record(name: str) -> str:
            """Read a record."""
            self.read.append(name)
            return f"{name}: ok"

        return [Tool(delete_record, destructive=True), Tool(read_record)]

    def model(self, calls: list[ToolCall]) -> FunctionModel:
        """Asks for ``calls`` in one turn, then answers with what the tools said."""

        def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
            self.model_calls += 1
            results = [m for m in messages if m.role == "tool"]
            if not results:
                return calls
            return "saw: " + " | ".join(f"{m.name}={m.content}" for m in results)

        return FunctionModel(decide)


DELETE = ToolCall(id="c1", name="delete_record", arguments={"name": "alpha"})
DELETE_2 = ToolCall(id="c2", name="delete_record", arguments={"name": "beta"})
READ = ToolCall(id="c3", name="read_record", arguments={"name": "gamma"})


def agent_for(
    world: World, runtime: JournalRuntime, calls: list[ToolCall], **options: Any
) -> Agent:
    options.setdefault("permissions", StandardPermissions(approval="defer"))
    return Agent(
        "x", model=world.model(calls), tools=world.tools(), runtime=runtime, memory=False, **options
    )


async def test_requests_are_listed_in_the_order_of_the_calls_whichever_is_checked_first(
    runtime_factory: Factory,
) -> None:
    """Parallel calls reach their permission check in any order (a slow guardrail, a busy
    journal): the result lists the requests in the order the model asked for them."""
    import asyncio

    from loomflow.hooks import RunHooks, RunInfo

    class SlowFirstCall(RunHooks):
        async def before_tool_call(
            self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Any
        ) -> ToolCall:
            if slot == 0:
                await asyncio.sleep(0.05)  # the second call's request is journaled first
            return call

    world = World()
    agent = agent_for(
        world, await runtime_factory(), [DELETE, DELETE_2], guardrails=[SlowFirstCall()]
    )
    result = await agent.run("clean up", session_id="s1", user_id="ana")
    assert [p.slot for p in result.pending_approvals] == [0, 1]
    listed = await agent.pending_approvals("s1", user_id="ana")
    assert [p.request_id for p in listed] == [p.request_id for p in result.pending_approvals]


async def test_the_run_stops_and_lists_every_request_of_the_turn(
    runtime_factory: Factory,
) -> None:
    world = World()
    agent = agent_for(world, await runtime_factory(), [DELETE, READ, DELETE_2])
    result = await agent.run("clean up", session_id="s1", user_id="ana")

    assert result.interrupted
    assert result.interruption_reason == "approval"
    pending = result.pending_approvals
    assert [(p.tool, p.arguments, p.slot) for p in pending] == [
        ("delete_record", {"name": "alpha"}, 0),
        ("delete_record", {"name": "beta"}, 2),
    ]
    assert all(p.request_id.startswith("apr_") for p in pending)
    assert len({p.request_id for p in pending}) == 2
    assert pending[0].session_id == "s1"
    assert pending[0].user_id == "ana"
    assert pending[0].run_id == result.run_id
    assert "destructive" in pending[0].reason
    # The call that needed nobody ran now; the others did not.
    assert world.read == ["gamma"]
    assert world.deleted == []

    # Another process on the same journal sees the same list.
    other = agent_for(World(), await runtime_factory(), [DELETE, READ, DELETE_2])
    assert await other.pending_approvals("s1", user_id="ana") == pending
    assert await other.pending_approvals("s1", user_id="bob") == []
    assert await other.pending_approvals("nope", user_id="ana") == []


async def test_resume_applies_decisions_once_in_another_process(
    runtime_factory: Factory,
) -> None:
    world = World()
    calls = [DELETE, READ, DELETE_2]
    first = await agent_for(world, await runtime_factory(), calls).run(
        "clean up", session_id="s1", user_id="ana"
    )
    alpha, beta = first.pending_approvals

    other_world = World()
    other = agent_for(other_world, await runtime_factory(), calls)
    result = await other.resume(
        "clean up",
        session_id="s1",
        user_id="ana",
        approvals={alpha.request_id: Approve(), beta.request_id: Deny("beta is still in use")},
        decided_by="carol",
    )
    assert not result.interrupted
    assert result.pending_approvals == []
    # The allowed call ran once, the read was replayed, the denial reached the model.
    assert other_world.deleted == ["alpha"]
    assert other_world.read == []
    assert "delete_record=deleted alpha" in result.output
    assert "read_record=gamma: ok" in result.output
    assert "permission denied" in result.output
    assert "beta is still in use" in result.output
    denial = [m for m in result.messages if m.role == "tool" and m.tool_call_id == "c2"]
    assert denial
    assert denial[0].is_error
    assert await other.pending_approvals("s1", user_id="ana") == []

    # Resuming again replays everything: the tool does not run a second time.
    again = await other.resume("clean up", session_id="s1", user_id="ana")
    assert again.output == result.output
    assert other_world.deleted == ["alpha"]
    assert again.fresh_steps == 0

    # A decision is final.
    with pytest.raises(ApprovalDecidedError) as caught:
        await other.resume(
            "clean up", session_id="s1", user_id="ana", approvals={alpha.request_id: "deny"}
        )
    assert caught.value.request_id == alpha.request_id
    assert "carol" in str(caught.value)
    assert other_world.deleted == ["alpha"]


async def test_resume_without_decisions_stays_interrupted_with_the_same_ids(
    runtime_factory: Factory,
) -> None:
    world = World()
    agent = agent_for(world, await runtime_factory(), [DELETE, DELETE_2])
    first = await agent.run("clean up", session_id="s1", user_id="ana")
    again = await agent.resume("clean up", session_id="s1", user_id="ana")
    assert again.interruption_reason == "approval"
    assert again.pending_approvals == first.pending_approvals
    assert world.model_calls == 1  # the model call replayed

    # Deciding one of two: it runs, the other keeps the run waiting.
    alpha, beta = first.pending_approvals
    partial = await agent.resume(
        "clean up", session_id="s1", user_id="ana", approvals={alpha.request_id: "allow"}
    )
    assert partial.interruption_reason == "approval"
    assert [p.request_id for p in partial.pending_approvals] == [beta.request_id]
    assert world.deleted == ["alpha"]
    done = await agent.resume(
        "clean up", session_id="s1", user_id="ana", approvals={beta.request_id: "allow"}
    )
    assert not done.interrupted
    assert world.deleted == ["alpha", "beta"]


async def test_edited_arguments_are_validated_and_used(runtime_factory: Factory) -> None:
    world = World()
    agent = agent_for(world, await runtime_factory(), [DELETE])
    (request,) = (await agent.run("clean up", session_id="s1", user_id="ana")).pending_approvals

    with pytest.raises(ApprovalArgumentsError) as caught:
        await agent.resume(
            "clean up",
            session_id="s1",
            user_id="ana",
            approvals={request.request_id: Approve(arguments={"name": 5, "extra": 1})},
        )
    assert "delete_record" in str(caught.value)
    assert "name" in str(caught.value)
    with pytest.raises(InvalidArgumentTypeError):
        await agent.resume(
            "clean up",
            session_id="s1",
            user_id="ana",
            approvals={request.request_id: Approve(arguments=["alpha"])},  # type: ignore[arg-type]
        )
    with pytest.raises(InvalidArgumentTypeError):
        await agent.resume(
            "clean up", session_id="s1", user_id="ana", approvals={request.request_id: "maybe"}
        )  # type: ignore[dict-item]
    # Nothing was recorded by the refused decisions: the request still waits.
    assert await agent.pending_approvals("s1", user_id="ana") == [request]

    result = await agent.resume(
        "clean up",
        session_id="s1",
        user_id="ana",
        approvals={request.request_id: Approve(arguments={"name": "alpha-copy"})},
    )
    assert world.deleted == ["alpha-copy"]
    assert "deleted alpha-copy" in result.output


async def test_edited_arguments_cannot_lift_a_deny_rule(runtime_factory: Factory) -> None:
    world = World()
    agent = Agent(
        "x",
        model=world.model([DELETE]),
        tools=world.tools(),
        runtime=await runtime_factory(),
        permissions=StandardPermissions(
            approval="defer", rules=[Rule.deny("delete_record", args={"name": "root"})]
        ),
        memory=False,
    )
    (request,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
    result = await agent.resume(
        "go",
        session_id="s1",
        user_id="ana",
        approvals={request.request_id: Approve(arguments={"name": "root"})},
    )
    assert world.deleted == []
    assert "edited arguments are denied" in result.output


async def test_unknown_ids_and_bad_input_are_refused(runtime_factory: Factory) -> None:
    world = World()
    agent = agent_for(world, await runtime_factory(), [DELETE])
    await agent.run("clean up", session_id="s1", user_id="ana")
    for bad in ("apr_000000000000000000000000", "", "x" * 300):
        with pytest.raises(ApprovalNotFoundError):
            await agent.resume("clean up", session_id="s1", user_id="ana", approvals={bad: "allow"})
    # An id pasted wrong (a whole file) is named, cut, not echoed whole.
    with pytest.raises(ApprovalNotFoundError, match=r"no approval request 'xxx") as refused:
        await agent.resume(
            "clean up", session_id="s1", user_id="ana", approvals={"x" * 100_000: "allow"}
        )
    assert len(str(refused.value)) < 500
    # Another user's session does not have the request.
    (request,) = await agent.pending_approvals("s1", user_id="ana")
    with pytest.raises(ApprovalNotFoundError):
        await agent.resume(
            "clean up", session_id="s1", user_id="bob", approvals={request.request_id: "allow"}
        )
    with pytest.raises(InvalidArgumentTypeError):
        await agent.resume(
            "clean up",
            session_id="s1",
            user_id="ana",
            approvals={7: "allow"},  # type: ignore[dict-item]
        )
    with pytest.raises(UserError, match="fork"):
        await agent.resume(
            "clean up",
            session_id="s1",
            user_id="ana",
            approvals={request.request_id: "allow"},
            from_checkpoint="01ABC",
        )
    with pytest.raises(InvalidArgumentTypeError, match="argument names are strings"):
        await agent.resume(
            "clean up",
            session_id="s1",
            user_id="ana",
            approvals={request.request_id: Approve(arguments={1: "alpha"})},  # type: ignore[dict-item]
        )
    with pytest.raises(UserError, match="map request ids"):
        await agent.resume(
            "clean up",
            session_id="s1",
            user_id="ana",
            approvals=[request.request_id],  # type: ignore[arg-type]
        )
    for who in ("", "carol\x00", "x" * 1000, 5):
        with pytest.raises(InvalidIdError):
            await agent.resume(
                "clean up",
                session_id="s1",
                user_id="ana",
                approvals={request.request_id: "allow"},
                decided_by=who,  # type: ignore[arg-type]
            )
    # A reason that is no text was journaled as its repr: the model was told "None".
    for decision in (Deny(None), Deny(5), Approve(reason=b"ok")):  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentTypeError, match="reason must be text"):
            await agent.resume(
                "clean up",
                session_id="s1",
                user_id="ana",
                approvals={request.request_id: decision},
            )
    assert world.deleted == []
    # Nothing above was recorded: the request still waits.
    assert await agent.pending_approvals("s1", user_id="ana") == [request]


async def test_a_resume_refused_for_its_own_arguments_records_no_decision(
    runtime_factory: Factory,
) -> None:
    """A resume whose other arguments are wrong (an output type that is no model, bad
    metadata, ...) is refused before its decisions are audited and journaled: a decision is
    final, so otherwise the corrected retry would be refused as already decided."""
    world = World()
    audit = AuditLog(InMemoryAuditStore())
    agent = agent_for(world, await runtime_factory(), [DELETE], audit=audit)
    (request,) = (await agent.run("clean up", session_id="s1", user_id="ana")).pending_approvals
    approve = {request.request_id: Approve()}
    wrong: list[dict[str, Any]] = [
        {"output_type": int},
        {"output_retries": -1},
        {"metadata": "not a mapping"},
        {"fork_session_id": "s9"},
    ]
    for options in wrong:
        with pytest.raises(UserError):
            await agent.resume(
                "clean up", session_id="s1", user_id="ana", approvals=approve, **options
            )
    with pytest.raises(UserError, match="prompt"):
        await agent.resume(
            None,  # type: ignore[arg-type]
            session_id="s1",
            user_id="ana",
            approvals=approve,
        )
    assert await agent.pending_approvals("s1", user_id="ana") == [request]
    entries = (await audit.query(user_id="ana", limit=100)).entries
    assert actions.APPROVAL_DECISION not in [e.action for e in entries]
    # The corrected call decides and runs.
    result = await agent.resume("clean up", session_id="s1", user_id="ana", approvals=approve)
    assert not result.interrupted
    assert world.deleted == ["alpha"]


async def test_a_resume_refused_for_its_prompt_by_a_snapshot_records_no_decision(
    runtime_factory: Factory,
) -> None:
    """With checkpoints on, the run's snapshot (taken after an earlier turn) was taken for
    the run's prompt, and a resume with another one is refused: before the decisions are
    audited and journaled, or the corrected retry would be refused as already decided."""
    from loomflow.agent import Tuning

    world = World()

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        done = [m for m in messages if m.role == "tool"]
        return [[READ], [DELETE]][len(done)] if len(done) < 2 else "done"

    audit = AuditLog(InMemoryAuditStore())
    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=world.tools(),
        runtime=await runtime_factory(),
        permissions=StandardPermissions(approval="defer"),
        memory=False,
        audit=audit,
        tuning=Tuning(checkpoint=True),
    )
    (request,) = (await agent.run("clean up", session_id="s1", user_id="ana")).pending_approvals
    assert await agent.list_checkpoints("s1", user_id="ana")  # the turn that read
    approve = {request.request_id: Approve()}
    with pytest.raises(UserError, match="was taken for the prompt 'clean up'"):
        await agent.resume("clean up!", session_id="s1", user_id="ana", approvals=approve)
    assert await agent.pending_approvals("s1", user_id="ana") == [request]
    entries = (await audit.query(user_id="ana", limit=100)).entries
    assert actions.APPROVAL_DECISION not in [e.action for e in entries]
    result = await agent.resume("clean up", session_id="s1", user_id="ana", approvals=approve)
    assert result.output == "done"
    assert world.deleted == ["alpha"]
    assert world.read == ["gamma"]  # restored from the snapshot, not read again


async def test_an_audit_refusal_on_a_later_decision_leaves_the_whole_call_retryable(
    tmp_path: Any,
) -> None:
    """Two decisions in one call, and the audit store refuses the entry of the second: no
    decision is journaled, so the same call, retried once the store takes entries again,
    records both (before, the first was final and the retry was refused as decided)."""
    import sqlite3

    from loomflow.audit import SqliteAuditStore
    from loomflow.errors import StoreUnavailableError
    from loomflow.runtime import SqliteRuntime

    world = World()
    audit_path = tmp_path / "audit.db"
    store = SqliteAuditStore(audit_path)
    async with SqliteRuntime(tmp_path / "journal.db") as runtime:
        agent = agent_for(world, runtime, [DELETE, DELETE_2], audit=AuditLog(store))
        alpha, beta = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
        with sqlite3.connect(audit_path) as db:  # the store refuses beta's decision entry
            db.execute(
                "CREATE TRIGGER refuse BEFORE INSERT ON loom_audit "
                f"WHEN NEW.payload LIKE '%{beta.request_id}%' "
                "AND NEW.action = 'approval.decision' BEGIN SELECT RAISE(ABORT, 'refused'); END"
            )
        decisions: dict[str, Any] = {alpha.request_id: Approve(), beta.request_id: Deny("no")}
        with pytest.raises(StoreUnavailableError, match="refused"):
            await agent.resume(
                "go", session_id="s1", user_id="ana", approvals=decisions, decided_by="kim"
            )
        assert await agent.pending_approvals("s1", user_id="ana") == [alpha, beta]
        assert world.deleted == []
        with sqlite3.connect(audit_path) as db:
            db.execute("DROP TRIGGER refuse")
        result = await agent.resume(
            "go", session_id="s1", user_id="ana", approvals=decisions, decided_by="kim"
        )
        assert not result.interrupted
        assert world.deleted == ["alpha"]
    await store.close()


async def test_defer_needs_a_journal() -> None:
    world = World()
    agent = Agent(
        "x",
        model=world.model([DELETE]),
        tools=world.tools(),
        permissions=StandardPermissions(approval="defer"),
        memory=False,
    )
    with pytest.raises(UserError, match="journaled runtime"):
        await agent.run("go")
    with pytest.raises(UserError, match="runtime"):
        await agent.pending_approvals("s1")
    assert world.deleted == []
    with pytest.raises(UserError, match="defer"):
        StandardPermissions(approval="later")  # type: ignore[arg-type]


async def test_audit_records_the_request_and_who_decided(runtime_factory: Factory) -> None:
    world = World()
    audit = AuditLog(InMemoryAuditStore())
    agent = agent_for(world, await runtime_factory(), [DELETE], audit=audit)
    (request,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
    await agent.resume(
        "go",
        session_id="s1",
        user_id="ana",
        approvals={request.request_id: Approve(arguments={"name": "alpha2"}, reason="ok")},
        decided_by="carol",
    )
    entries = (await audit.query(user_id="ana", limit=100)).entries
    by_action = {e.action: e for e in entries}
    asked = by_action[actions.APPROVAL_REQUEST]
    assert asked.payload["request_id"] == request.request_id
    assert asked.payload["tool"] == "delete_record"
    decided = by_action[actions.APPROVAL_DECISION]
    assert decided.actor == "approver:carol"
    assert decided.payload["decision"] == "allow"
    assert decided.payload["edited"] is True
    assert decided.payload["arguments"] == {"name": "alpha2"}
    assert decided.payload["decided_at"]
    assert decided.run_id == request.run_id
    applied = [e for e in entries if e.action == actions.PERMISSION_DECISION]
    assert applied[-1].payload["approver"] == "carol"
    assert applied[-1].payload["edited"]
    order = [e.action for e in entries]
    assert order.index(actions.APPROVAL_DECISION) < order.index(actions.TOOL_CALL)
    # The trail's tool.call says what the tool ran with: the edit, not the model's arguments.
    assert world.deleted == ["alpha2"]
    (ran,) = [e for e in entries if e.action == actions.TOOL_CALL]
    assert ran.payload["arguments"] == {"name": "alpha2"}
    assert ran.payload["executed"] is True


async def test_no_budget_reservation_is_held_while_waiting(runtime_factory: Factory) -> None:
    world = World()
    store = InMemoryBudgetStore()
    budget = StandardBudget([Cap("tokens_total", 1_000_000)], store=store)
    agent = agent_for(world, await runtime_factory(), [DELETE], budget=budget)
    result = await agent.run("go", session_id="s1", user_id="ana")
    assert result.interruption_reason == "approval"
    assert await store.reservations() == []


async def test_the_in_process_handler_still_works(runtime_factory: Factory) -> None:
    world = World()
    agent = Agent(
        "x",
        model=world.model([DELETE]),
        tools=world.tools(),
        runtime=await runtime_factory(),
        permissions=StandardPermissions(approval=lambda request: True),
        memory=False,
    )
    result = await agent.run("go", session_id="s1", user_id="ana")
    assert not result.interrupted
    assert world.deleted == ["alpha"]
    assert result.pending_approvals == []
    assert PERMISSION_DENIED not in result.output


def test_pending_approval_is_plain_data() -> None:
    request = PendingApproval(request_id="apr_1", tool="t", session_id="s", turn=0, slot=0, epoch=0)
    assert PendingApproval.model_validate_json(request.model_dump_json()) == request


async def test_memory_and_checkpoints_resume_across_the_wait(runtime_factory: Factory) -> None:
    from loomflow.agent import Tuning
    from loomflow.memory import InMemoryMemory

    world = World()
    runtime = await runtime_factory()
    agent = Agent(
        "x",
        model=world.model([DELETE]),
        tools=world.tools(),
        runtime=runtime,
        permissions=StandardPermissions(approval="defer"),
        memory=InMemoryMemory(),
        tuning=Tuning(checkpoint=True),
    )
    (request,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
    result = await agent.resume(
        "go", session_id="s1", user_id="ana", approvals={request.request_id: "allow"}
    )
    assert not result.interrupted
    assert world.deleted == ["alpha"]
    assert result.output == "saw: delete_record=deleted alpha"
    assert world.model_calls == 2  # the first model call was not made again


async def test_an_agent_used_as_a_tool_cannot_wait_and_is_denied(
    runtime_factory: Factory,
) -> None:
    world = World()
    runtime = await runtime_factory()
    inner = agent_for(world, runtime, [DELETE])
    delegate = ToolCall(id="d1", name="cleaner", arguments={"task": "clean"})

    def outer_model(messages: list[Message], tools: list[ToolSpec]) -> Any:
        results = [m for m in messages if m.role == "tool"]
        return [delegate] if not results else "outer saw: " + results[-1].content

    outer = Agent(
        "outer",
        model=FunctionModel(outer_model),
        tools=[inner.as_tool("cleaner")],
        runtime=runtime,
        memory=False,
    )
    result = await outer.run("go", session_id="s1", user_id="ana")
    assert not result.interrupted
    assert world.deleted == []
    assert "sub-run" in result.output
    assert await outer.pending_approvals("s1", user_id="ana") == []


async def test_a_workflow_node_cannot_wait_and_the_denial_says_why(
    runtime_factory: Factory,
) -> None:
    """A workflow node, a debater and a team worker are sub-runs too: the call is denied, and
    the reason the model (and the trail) gets names them, not only "an agent used as a tool"
    (which a workflow node is not). The approvals page lists them among its limits."""
    from pathlib import Path

    from loomflow.agent.architectures import Workflow

    world = World()
    flow = Workflow([("clean", agent_for(world, await runtime_factory(), [DELETE]))])
    result = await flow.run("go", session_id="s1", user_id="ana")
    assert not result.interrupted
    assert world.deleted == []
    assert "a workflow node" in result.output
    limits = (Path(__file__).parents[2] / "docs" / "approvals.md").read_text()
    assert "a workflow's agent nodes" in " ".join(limits.split())


async def test_a_new_run_leaves_the_old_requests_behind(runtime_factory: Factory) -> None:
    world = World()
    agent = agent_for(world, await runtime_factory(), [DELETE])
    (old,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
    (new,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
    assert new.request_id != old.request_id
    assert new.epoch == old.epoch + 1
    assert await agent.pending_approvals("s1", user_id="ana") == [new]
    with pytest.raises(ApprovalNotFoundError):
        await agent.resume(
            "go", session_id="s1", user_id="ana", approvals={old.request_id: "allow"}
        )
    assert world.deleted == []


async def test_stream_ends_with_the_pending_requests(runtime_factory: Factory) -> None:
    from loomflow.agent import RunFinished, ToolCallFinished

    world = World()
    agent = agent_for(world, await runtime_factory(), [DELETE, READ])
    events = [e async for e in agent.stream("go", session_id="s1", user_id="ana")]
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    assert [p.tool for p in finished.result.pending_approvals] == ["delete_record"]
    # The turn stopped before its results were handed to the model: none is reported yet.
    assert not [e for e in events if isinstance(e, ToolCallFinished)]


async def test_crafted_journal_rows_are_not_trusted(tmp_path: Any) -> None:
    import sqlite3

    from loomflow.errors import CorruptEntryError
    from loomflow.runtime import SqliteRuntime, codec

    path = tmp_path / "journal.db"
    world = World()
    async with SqliteRuntime(path) as runtime:
        agent = agent_for(world, runtime, [DELETE, DELETE_2])
        first = await agent.run("go", session_id="s1", user_id="ana")
        alpha, beta = first.pending_approvals
        # A decision for alpha is journaled without running (a shell's approve)...
        from loomflow.governance.approvals import journal_decisions, normalize_decision

        await journal_decisions(
            runtime,
            "s1",
            "ana",
            {alpha.request_id: normalize_decision(alpha.request_id, "allow", "c")},
        )
    # ...then someone rewrites the rows: beta's request becomes junk, alpha's decision a shape
    # no decision has (a "maybe" that must never run the tool).
    junk = codec.dumps({"request_id": beta.request_id, "tool": 5})
    maybe = codec.dumps({"request_id": alpha.request_id, "behavior": "maybe", "code": "rm -rf"})
    with sqlite3.connect(path) as db:
        db.execute("UPDATE loom_entries SET value = ? WHERE name = 'approval_request_0_1'", (junk,))
        db.execute(
            "UPDATE loom_entries SET value = ? WHERE name LIKE 'approval_decision_0_0_%'", (maybe,)
        )
    async with SqliteRuntime(path) as runtime:
        agent = agent_for(world, runtime, [DELETE, DELETE_2])
        # Neither is listed: the junk request, nor alpha, whose shapeless decision is what
        # the run reads back at it (deciding again would journal nothing over it).
        assert await agent.pending_approvals("s1", user_id="ana") == []
        with pytest.raises(CorruptEntryError, match=r"its decision .* is damaged"):
            await agent.resume(
                "go", session_id="s1", user_id="ana", approvals={alpha.request_id: "allow"}
            )
        with pytest.raises(CorruptEntryError):
            await agent.resume("go", session_id="s1", user_id="ana")
    assert world.deleted == []


def _edit_request(path: Any, name: str, field: str, value: str) -> None:
    """Rewrite one field of a journaled request, as anyone with the SQLite file could."""
    import sqlite3

    with sqlite3.connect(path) as db:
        changed = db.execute(
            f"UPDATE loom_entries SET value = CAST(json_set(CAST(value AS TEXT), '$.{field}', "
            f"json(?)) AS BLOB) WHERE name = ?",
            (value, name),
        ).rowcount
    assert changed == 1


async def test_a_request_naming_another_user_is_damaged_for_the_python_api(
    tmp_path: Any,
) -> None:
    from loomflow.errors import CorruptEntryError
    from loomflow.governance.approvals import (
        journal_decisions,
        normalize_decision,
        read_approvals,
    )
    from loomflow.runtime import SqliteRuntime

    path = tmp_path / "journal.db"
    world = World()
    async with SqliteRuntime(path) as runtime:
        (alpha,) = (
            await agent_for(world, runtime, [DELETE]).run("go", session_id="s1", user_id="ana")
        ).pending_approvals
    _edit_request(path, "approval_request_0_0", "user_id", '"mallory"')

    audit = AuditLog(InMemoryAuditStore())
    async with SqliteRuntime(path) as runtime:
        agent = agent_for(world, runtime, [DELETE], audit=audit)
        ledger = await read_approvals(runtime, "s1", "ana")
        assert ledger.requests == {}
        [damaged] = ledger.damaged
        assert damaged.request_id == alpha.request_id
        assert "mallory" in damaged.problem
        assert await agent.pending_approvals("s1", user_id="ana") == []
        with pytest.raises(CorruptEntryError, match="names user 'mallory'"):
            await agent.resume(
                "go", session_id="s1", user_id="ana", approvals={alpha.request_id: "allow"}
            )
        with pytest.raises(CorruptEntryError, match="damaged"):
            await journal_decisions(
                runtime,
                "s1",
                "ana",
                {alpha.request_id: normalize_decision(alpha.request_id, "allow", "kim")},
            )
        # Neither trail got a decision; the plain resume refuses the record too.
        for user in ("ana", "mallory"):
            page = await audit.query(user_id=user, action=actions.APPROVAL_DECISION)
            assert page.entries == []
        with pytest.raises(CorruptEntryError, match="mallory"):
            await agent.resume("go", session_id="s1", user_id="ana")
    assert world.deleted == []


@pytest.mark.parametrize("turn", ["-1", "99999999999"])
async def test_a_request_with_a_turn_it_is_not_stored_at_is_refused(
    turn: str, tmp_path: Any
) -> None:
    from loomflow.errors import CorruptEntryError
    from loomflow.governance.approvals import journal_decisions, normalize_decision
    from loomflow.runtime import SqliteRuntime

    path = tmp_path / "journal.db"
    world = World()
    async with SqliteRuntime(path) as runtime:
        agent = agent_for(world, runtime, [DELETE, DELETE_2])
        alpha, beta = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
        # beta is decided properly first: its edited record must not run it either.
        await journal_decisions(
            runtime,
            "s1",
            "ana",
            {beta.request_id: normalize_decision(beta.request_id, "allow", "k")},
        )
    _edit_request(path, "approval_request_0_0", "turn", turn)
    _edit_request(path, "approval_request_0_1", "turn", turn)

    async with SqliteRuntime(path) as runtime:
        agent = agent_for(world, runtime, [DELETE, DELETE_2])
        with pytest.raises(CorruptEntryError, match="damaged"):
            await agent.resume(
                "go", session_id="s1", user_id="ana", approvals={alpha.request_id: "allow"}
            )
        with pytest.raises(CorruptEntryError, match="approval_request_0_0"):
            await agent.resume("go", session_id="s1", user_id="ana")
    assert world.deleted == []


async def test_deeply_nested_edited_arguments_are_refused() -> None:
    from loomflow.governance.approvals import normalize_decision

    deep: Any = []
    for _ in range(5_000):
        deep = [deep]
    with pytest.raises(InvalidArgumentTypeError, match="nested more than"):
        normalize_decision("apr_x", Approve(arguments={"name": deep}), "kim")


async def test_edited_bytes_that_are_not_utf8_are_refused_before_anything_is_recorded(
    runtime_factory: Factory,
) -> None:
    """An edit of a ``bytes`` argument passes the tool's schema, but the journal keeps a
    decision as JSON, bytes as UTF-8 text: ``b"\\xff"`` escaped the checks and ended the
    resume with a bare ``UnicodeDecodeError`` while the decision was being journaled."""
    stored: list[bytes] = []

    def store_blob(blob: bytes) -> str:
        """Overwrite the stored blob."""
        stored.append(blob)
        return "stored"

    world = World()
    audit = AuditLog(InMemoryAuditStore())
    agent = Agent(
        "x",
        model=world.model([ToolCall(id="c1", name="store_blob", arguments={"blob": "abc"})]),
        tools=[Tool(store_blob, destructive=True)],
        runtime=await runtime_factory(),
        memory=False,
        permissions=StandardPermissions(approval="defer"),
        audit=audit,
    )
    (request,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
    with pytest.raises(InvalidArgumentTypeError, match="edited arguments must be JSON values"):
        await agent.resume(
            "go",
            session_id="s1",
            user_id="ana",
            approvals={request.request_id: Approve(arguments={"blob": b"\xff"})},
        )
    # Nothing recorded: the request still waits, no decision was audited.
    assert await audit.count(action=actions.APPROVAL_DECISION) == 0
    waiting = await agent.pending_approvals("s1", user_id="ana")
    assert [p.request_id for p in waiting] == [request.request_id]
    result = await agent.resume(
        "go",
        session_id="s1",
        user_id="ana",
        approvals={request.request_id: Approve(arguments={"blob": "xyz"})},
    )
    assert not result.interrupted
    assert stored == [b"xyz"]


async def test_a_secret_the_model_puts_in_an_argument_key_is_redacted_in_the_request(
    runtime_factory: Factory,
) -> None:
    """Values that look like secrets were redacted, but object keys were not: a model that
    keyed a header by an API key showed the key in ``pending_approvals``, ``approvals
    list`` and the ``approval.request`` audit entry (the ``tool.call`` entry hid it)."""
    key = "sk-ant-api03-" + "k" * 40

    def call_api(url: str, headers: dict[str, str]) -> str:
        """Call an API."""
        return "ok"

    world = World()
    audit = AuditLog(InMemoryAuditStore())
    agent = Agent(
        "x",
        model=world.model(
            [ToolCall(id="c1", name="call_api", arguments={"url": "u", "headers": {key: "v"}})]
        ),
        tools=[Tool(call_api, destructive=True)],
        runtime=await runtime_factory(),
        memory=False,
        permissions=StandardPermissions(approval="defer"),
        audit=audit,
    )
    (request,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
    assert key not in request.model_dump_json()
    assert request.arguments["url"] == "u"
    (listed,) = await agent.pending_approvals("s1", user_id="ana")
    assert key not in listed.model_dump_json()
    (entry,) = (await audit.query(user_id="ana", action=actions.APPROVAL_REQUEST)).entries
    assert key not in str(entry.payload)
    # An edit copied from the request keeps the redacted key: refused, as a redacted value is.
    with pytest.raises(ApprovalArgumentsError, match="the request's redacted value"):
        await agent.resume(
            "go",
            session_id="s1",
            user_id="ana",
            approvals={request.request_id: Approve(arguments={**request.arguments, "url": "w"})},
        )


async def test_a_request_the_run_went_past_no_longer_waits(runtime_factory: Factory) -> None:
    """Resumed under a policy that no longer asks, the run settles the call without a
    decision: its request is not listed, and deciding it records and audits nothing."""
    world = World()
    agent = agent_for(world, await runtime_factory(), [DELETE])
    (request,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals

    audit = AuditLog(InMemoryAuditStore())
    relaxed = Agent(
        "x",
        model=world.model([DELETE]),
        tools=world.tools(),
        runtime=await runtime_factory(),
        permissions=StandardPermissions("bypass", approval="defer"),
        memory=False,
        audit=audit,
    )
    result = await relaxed.resume("go", session_id="s1", user_id="ana")
    assert not result.interrupted
    assert world.deleted == ["alpha"]

    assert await relaxed.pending_approvals("s1", user_id="ana") == []
    with pytest.raises(ApprovalDecidedError, match="no longer waits"):
        await relaxed.resume(
            "go",
            session_id="s1",
            user_id="ana",
            approvals={request.request_id: Deny("too late")},
            decided_by="kim",
        )
    assert await audit.count(user_id="ana", action=actions.APPROVAL_DECISION) == 0
    assert world.deleted == ["alpha"]


async def test_a_call_asked_where_an_earlier_call_ran_can_be_decided(
    runtime_factory: Factory,
) -> None:
    """A redeploy changes the instructions while a run waits: the resume makes the model call
    again, and the model now asks, at the place where a call that needed nobody already ran,
    for one that needs approval. The run stops at it; the result of the earlier call must not
    make the new request look settled (unlisted, and refused as "no longer waits"), or the
    run could never go on."""
    world = World()
    before = Agent(
        "v1",
        model=world.model([READ, DELETE]),
        tools=world.tools(),
        runtime=await runtime_factory(),
        permissions=StandardPermissions(approval="defer"),
        memory=False,
    )
    await before.run("go", session_id="s1", user_id="ana")
    assert world.read == ["gamma"]
    after = Agent(
        "v2",
        model=world.model([DELETE]),
        tools=world.tools(),
        runtime=await runtime_factory(),
        permissions=StandardPermissions(approval="defer"),
        memory=False,
    )
    stopped = await after.resume("go", session_id="s1", user_id="ana")
    (request,) = stopped.pending_approvals
    assert (request.turn, request.slot) == (0, 0)
    listed = await after.pending_approvals("s1", user_id="ana")
    assert request in listed
    result = await after.resume(
        "go", session_id="s1", user_id="ana", approvals={request.request_id: Approve()}
    )
    assert not result.interrupted
    assert world.deleted == ["alpha"]
    # The request of the first model call's second slot was never reached again: the run
    # finished, so it waits for nothing, is not listed, and cannot be decided.
    (stale,) = [r for r in listed if r.request_id != request.request_id]
    assert await after.pending_approvals("s1", user_id="ana") == []
    with pytest.raises(ApprovalDecidedError, match="the run finished"):
        await after.resume(
            "go", session_id="s1", user_id="ana", approvals={stale.request_id: Approve()}
        )


async def test_a_decision_edited_to_name_a_hostile_approver_is_damaged(tmp_path: Any) -> None:
    """decided_by becomes the audit actor: read back holding a control character, the
    decision is a damaged record (the resume raises CorruptEntryError), not an actor."""
    from loomflow.audit import SqliteAuditStore
    from loomflow.errors import CorruptEntryError
    from loomflow.governance.approvals import journal_decisions, normalize_decision
    from loomflow.runtime import SqliteRuntime

    path = tmp_path / "journal.db"
    world = World()
    async with SqliteRuntime(path) as runtime:
        agent = agent_for(world, runtime, [DELETE])
        (request,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
        await journal_decisions(
            runtime,
            "s1",
            "ana",
            {request.request_id: normalize_decision(request.request_id, "allow", "kim")},
        )
    _edit_request(
        path,
        f"approval_decision_0_0_{request.request_id}",
        "decided_by",
        '"kim\\u001b[2J"',
    )
    store = SqliteAuditStore(tmp_path / "audit.db")
    async with SqliteRuntime(path) as runtime:
        agent = agent_for(world, runtime, [DELETE], audit=AuditLog(store))
        with pytest.raises(CorruptEntryError, match="control character"):
            await agent.resume("go", session_id="s1", user_id="ana")
    actors = {e.actor for e in (await store.query(user_id="ana", limit=100)).entries}
    await store.close()
    assert not any("\x1b" in actor for actor in actors)
    assert world.deleted == []


async def test_a_decision_too_large_to_journal_is_not_audited(tmp_path: Any) -> None:
    """The decision is sized before its audit entry is written: one the journal refuses
    (PayloadTooLargeError) leaves no approval.decision standing for nothing."""
    from loomflow.audit import SqliteAuditStore
    from loomflow.errors import PayloadTooLargeError
    from loomflow.runtime import SqliteRuntime

    world = World()
    store = SqliteAuditStore(tmp_path / "audit.db")
    async with SqliteRuntime(tmp_path / "journal.db", max_payload_bytes=4096) as runtime:
        agent = agent_for(world, runtime, [DELETE], audit=AuditLog(store))
        (request,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
        with pytest.raises(PayloadTooLargeError, match="approval_decision_0_0"):
            await agent.resume(
                "go",
                session_id="s1",
                user_id="ana",
                approvals={request.request_id: Deny("r" * 10_000)},
                decided_by="kim",
            )
        assert await store.count(user_id="ana", action=actions.APPROVAL_DECISION) == 0
        # Nothing was recorded: the request still waits and a decision of a fitting size works.
        assert [p.request_id for p in await agent.pending_approvals("s1", user_id="ana")] == [
            request.request_id
        ]
        result = await agent.resume(
            "go",
            session_id="s1",
            user_id="ana",
            approvals={request.request_id: Deny("too risky")},
            decided_by="kim",
        )
    assert "too risky" in result.output
    assert await store.count(user_id="ana", action=actions.APPROVAL_DECISION) == 1
    await store.close()
    assert world.deleted == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tool", '"read_record"'),
        ("arguments", '{"name": "harmless"}'),
        ("reason", '"a routine read"'),
        ("policy", '"user:ana"'),
    ],
)
async def test_a_request_edited_to_show_another_call_is_never_decided_into_running(
    field: str, value: str, tmp_path: Any
) -> None:
    """The person decides on what the record shows; the call that runs is the journaled
    model's. A record edited to show another tool or arguments (its id left as it was) is
    listed as damaged and cannot be decided, and the run's resume refuses it."""
    from loomflow.errors import CorruptEntryError
    from loomflow.governance.approvals import journal_decisions, normalize_decision
    from loomflow.runtime import SqliteRuntime

    path = tmp_path / "journal.db"
    world = World()
    async with SqliteRuntime(path) as runtime:
        (alpha,) = (
            await agent_for(world, runtime, [DELETE]).run("go", session_id="s1", user_id="ana")
        ).pending_approvals
    _edit_request(path, "approval_request_0_0", field, value)

    async with SqliteRuntime(path) as runtime:
        agent = agent_for(world, runtime, [DELETE])
        assert await agent.pending_approvals("s1", user_id="ana") == []  # not offered
        with pytest.raises(CorruptEntryError, match=r"changed after it was journaled"):
            await journal_decisions(
                runtime,
                "s1",
                "ana",
                {alpha.request_id: normalize_decision(alpha.request_id, "allow", "kim")},
            )
        with pytest.raises(CorruptEntryError, match=r"approval_request_0_0.*damaged"):
            await agent.resume("go", session_id="s1", user_id="ana")
    assert world.deleted == []


async def test_nobody_is_asked_to_approve_a_tool_the_model_made_up(
    runtime_factory: Factory,
) -> None:
    # A rule asks for every call; the model also calls a tool that does not exist. The run
    # stopped for approval of that name too, and an approver could only "allow" an error
    # (or, with a later hook that answers such names, something nobody vetted).
    world = World()
    made_up = ToolCall(id="c9", name="wipe_disk", arguments={"all": True})
    agent = Agent(
        "x",
        model=world.model([READ, made_up]),
        tools=world.tools(),
        runtime=await runtime_factory(),
        permissions=StandardPermissions(rules=[Rule.ask("*")], approval="defer"),
        memory=False,
    )
    result = await agent.run("clean up", session_id="s1", user_id="ana")
    assert result.interruption_reason == "approval"
    [request] = result.pending_approvals  # the real tool only
    assert request.tool == "read_record"
    resumed = await agent.resume(
        "clean up", session_id="s1", user_id="ana", approvals={request.request_id: Approve()}
    )
    assert not resumed.interrupted
    [denied] = [m for m in resumed.messages if m.role == "tool" and m.tool_call_id == "c9"]
    assert denied.is_error
    assert "no tool of that name is registered, so nobody is asked" in denied.content
    assert world.read == ["gamma"]


async def test_requests_with_any_json_arguments_list_and_decide_as_asked(
    runtime_factory: Factory,
) -> None:
    # A listed request is checked against its id (a hash of what it showed): every kind of
    # JSON value a model sends must read back as it was hashed, or a real request would be
    # called damaged and could never be decided.
    arguments = {
        "name": "ålpha ✓ 🚀",
        "reason": "x" * 300,
        "n": 12345678901234567890,
        "ratio": 0.1,
        "whole": 2.0,
        "flags": [True, False, None],
        "nested": {"b": [1, {"c": "d"}], "a": {}},
        "empty": [],
        "$t": "a key that looks like the journal's tag",
    }
    world = World()
    call = ToolCall(id="c1", name="delete_record", arguments=arguments)
    runtime = await runtime_factory()
    agent = agent_for(world, runtime, [call])
    (request,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
    assert [p.request_id for p in await agent.pending_approvals("s1", user_id="ana")] == [
        request.request_id
    ]
    result = await agent.resume(
        "go", session_id="s1", user_id="ana", approvals={request.request_id: Approve()}
    )
    assert not result.interrupted
    # Approved: the call went to the tool (which refuses the extra arguments as invalid).
    [answer] = [m for m in result.messages if m.role == "tool"]
    assert "permission denied" not in answer.content
    assert await agent.pending_approvals("s1", user_id="ana") == []


async def test_a_check_that_raises_on_an_edit_denies_it_on_resume(
    runtime_factory: Factory,
) -> None:
    """A custom check that fails for the edited arguments fails closed, as it does for the
    model's call: the resumed run gives the model the denial and finishes (it raised the
    check's RuntimeError on every resume, and the run could never finish)."""

    class FailsOnEdits(StandardPermissions):
        def check(self, call: ToolCall, **kwargs: Any) -> Any:
            if call.arguments.get("name") == "edited":
                raise RuntimeError("policy service down")
            return super().check(call, **kwargs)

    world = World()
    runtime = await runtime_factory()
    agent = agent_for(world, runtime, [DELETE], permissions=FailsOnEdits(approval="defer"))
    stopped = await agent.run("clean up", session_id="s1", user_id="ana")
    [request] = stopped.pending_approvals
    result = await agent.resume(
        "clean up",
        session_id="s1",
        user_id="ana",
        approvals={request.request_id: Approve(arguments={"name": "edited"})},
        decided_by="kim",
    )
    assert world.deleted == []
    assert not result.interrupted
    assert "policy service down" in result.output
    [session] = await runtime.sessions(session_id="s1")
    assert session.state == "finished"


async def test_a_deferred_decision_without_a_name_is_applied_as_an_approvers(
    runtime_factory: Factory,
) -> None:
    # resume(approvals=...) without decided_by: approval.decision said actor "approver",
    # and the permission.decision that applied it said policy:<policy>.
    world = World()
    audit = AuditLog(InMemoryAuditStore())
    agent = agent_for(world, await runtime_factory(), [DELETE], audit=audit)
    (request,) = (await agent.run("go", session_id="s1", user_id="ana")).pending_approvals
    await agent.resume(
        "go", session_id="s1", user_id="ana", approvals={request.request_id: "allow"}
    )
    entries = (await audit.query(user_id="ana", limit=100)).entries
    [applied] = [e for e in entries if e.action == actions.PERMISSION_DECISION]
    assert applied.actor == "approver"
    assert world.deleted == ["alpha"]
