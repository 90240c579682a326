"""Team, Debate and Workflow journal under the enclosing run and replay on resume."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow.agent import Agent, Tuning
from loomflow.agent.architectures import Debate, Team, Workflow
from loomflow.errors import InvalidArgumentTypeError, UserError
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import JournalRuntime
from loomflow.tools import tool

Factory = Callable[..., Awaitable[JournalRuntime]]


class Crash(Exception):
    pass


@pytest.mark.parametrize("checkpoint", [False, True], ids=["replay", "snapshot"])
async def test_team_workers_remember_within_a_run_and_replay_on_resume(
    runtime_factory: Factory, checkpoint: bool
) -> None:
    lookups: list[str] = []

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        lookups.append(q)
        return f"facts about {q}"

    seen_histories: list[int] = []

    def worker_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return f"research: {messages[-1].content}"
        seen_histories.append(len(messages))
        return [ToolCall(id="l", name="lookup", arguments={"q": messages[-1].content})]

    crash = True

    def lead_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        asked = [m for m in messages if m.role == "tool"]
        if len(asked) == 0:
            return [ToolCall(id="a", name="ask_researcher", arguments={"task": "tides"})]
        if len(asked) == 1:
            if crash:
                raise Crash
            return [ToolCall(id="b", name="ask_researcher", arguments={"task": "moons"})]
        return "report: " + " | ".join(m.content for m in asked)

    runtime = await runtime_factory()
    worker = Agent(
        "research", model=FunctionModel(worker_decides), tools=[lookup], name="researcher"
    )
    lead = Agent(
        "lead",
        model=FunctionModel(lead_decides),
        runtime=runtime,
        tuning=Tuning(checkpoint=checkpoint),
    )
    team = Team(lead, [worker])
    with pytest.raises(Crash):
        await team.run("write a report", session_id="s", user_id="u")
    assert lookups == ["tides"]
    crash = False
    result = await team.resume("write a report", session_id="s", user_id="u")
    assert result.output == "report: research: facts about tides | research: facts about moons"
    assert lookups == ["tides", "moons"]
    # The second task saw the first exchange in the worker's memory (system+2 history+user),
    # whether the earlier turns came back by replay or from the lead's snapshot.
    assert seen_histories == [2, 4]
    assert (result.restored_from is not None) is checkpoint


async def test_debate_replays_debaters_on_resume(runtime_factory: Factory) -> None:
    calls: list[str] = []

    def debater(name: str) -> Agent:
        def speak(messages: list[Message], tools: list[ToolSpec]) -> Any:
            calls.append(name)
            return f"{name} argues #{len(calls)}"

        return Agent("debate", model=FunctionModel(speak), name=name)

    crash = True

    def judge_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if crash:
            raise Crash
        return "pro wins"

    runtime = await runtime_factory()
    debate = Debate(
        [debater("pro"), debater("con")],
        Agent("judge", model=FunctionModel(judge_decides), name="judge"),
        rounds=2,
        runtime=runtime,
    )
    with pytest.raises(Crash):
        await debate.run("tabs or spaces", session_id="s", user_id="u")
    assert calls == ["pro", "con", "pro", "con"]
    crash = False
    result = await debate.resume("tabs or spaces", session_id="s", user_id="u")
    assert result.output == "pro wins"
    assert calls == ["pro", "con", "pro", "con"]  # no debater spoke again
    assert result.replayed_steps == 4
    assert result.turns == 5


async def test_workflow_nodes_replay_on_resume(runtime_factory: Factory) -> None:
    executed: list[str] = []
    crash = True

    def outline(messages: list[Message], tools: list[ToolSpec]) -> Any:
        executed.append("outline")
        return f"outline of {messages[-1].content}"

    async def publish(text: str) -> str:
        executed.append("publish")
        if crash:
            raise Crash
        return f"published: {text}"

    runtime = await runtime_factory()
    flow = Workflow(
        [
            ("outline", Agent("o", model=FunctionModel(outline))),
            ("shout", lambda text: text.upper()),
            ("publish", publish),
        ],
        runtime=runtime,
    )
    with pytest.raises(Crash):
        await flow.run("a poem", session_id="s", user_id="u")
    crash = False
    result = await flow.resume("a poem", session_id="s", user_id="u")
    assert result.output == "published: OUTLINE OF A POEM"
    assert executed == ["outline", "publish", "publish"]


async def test_a_debate_or_workflow_built_without_a_runtime_journals_on_its_agents(
    runtime_factory: Factory,
) -> None:
    """The docs build ``Debate(debaters, judge)`` and ``Workflow([...])`` without a runtime:
    given agents that have one, a resume replays the finished agents instead of calling
    (and paying) their models again."""
    calls: list[str] = []
    crash = True

    def says(name: str) -> Callable[[list[Message], list[ToolSpec]], str]:
        def decide(messages: list[Message], tools: list[ToolSpec]) -> str:
            calls.append(name)
            if name == "judge" and crash:
                raise Crash
            return f"{name} argues"

        return decide

    runtime = await runtime_factory()

    def agent(name: str) -> Agent:
        return Agent("x", model=FunctionModel(says(name)), runtime=runtime, name=name)

    debate = Debate([agent("pro"), agent("con")], agent("judge"), rounds=1)
    flow = Workflow([("draft", agent("pro")), ("review", agent("judge"))], name="flow")
    assert debate.runtime is runtime
    assert flow.runtime is runtime
    for built, first in ((debate, ["pro", "con", "judge"]), (flow, ["pro", "judge"])):
        crash, session = True, f"s-{type(built).__name__}"
        calls.clear()
        with pytest.raises(Crash):
            await built.run("topic", session_id=session, user_id="u")
        assert calls == first
        crash = False
        result = await built.resume("topic", session_id=session, user_id="u")
        assert calls == [*first, "judge"]  # only the judge, which had crashed, ran again
        assert result.replayed_steps == len(first) - 1
    # A named one records its runs, so a recovery worker takes it (Recovery checks a runtime).
    from loomflow.recovery import Recovery

    Recovery(runtime, {"flow": flow})


def _cleaner(deleted: list[str], **options: Any) -> Agent:
    """An agent that deletes everything at once, which its permissions deny the viewer role."""
    from loomflow.governance import Policy, Rule, StandardPermissions

    @tool
    def delete_all(what: str) -> str:
        """Delete everything."""
        deleted.append(what)
        return "deleted"

    def wants_to_delete(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return f"result: {messages[-1].content}"
        return [ToolCall(id="d", name="delete_all", arguments={"what": "db"})]

    deny = Policy(rules=[Rule.deny("delete_all")])
    permissions = StandardPermissions(roles={"viewer": deny})
    model = FunctionModel(wants_to_delete)
    return Agent("x", model=model, tools=[delete_all], permissions=permissions, **options)


async def test_a_debate_or_workflow_runs_its_agents_with_its_metadata(
    runtime_factory: Factory,
) -> None:
    """A run's roles are its metadata's: an agent node or a debater is decided on with the
    roles of the run it works in (as a team worker or an agent used as a tool is), also when
    the run is resumed without ``metadata=`` (it keeps its recorded one, as an agent's
    does). Left without them, a role's deny rule let the node run the tool."""
    deleted: list[str] = []
    crash = True

    def first(text: str) -> str:
        if crash:
            raise Crash
        return text

    cleaner = _cleaner(deleted, runtime=(runtime := await runtime_factory()))
    viewer = {"role": "viewer"}
    flow = Workflow([("first", first), ("clean", cleaner)], runtime=runtime, name="flow")
    with pytest.raises(Crash):
        await flow.run("go", session_id="w", user_id="u", metadata=viewer)
    crash = False
    result = await flow.resume("go", session_id="w", user_id="u")
    assert "permission denied" in result.output
    judge = Agent("j", model=FunctionModel(lambda messages, tools: "judged"), runtime=runtime)
    debate = Debate([cleaner], judge, rounds=1, runtime=runtime)
    await debate.run("go", session_id="d", user_id="u", metadata=viewer)
    assert deleted == []


async def test_a_team_run_takes_metadata_that_its_workers_are_decided_on(
    runtime_factory: Factory,
) -> None:
    """``Team.run``/``stream``/``resume`` take ``metadata=`` as an agent's do: a run's roles
    reach the lead and its workers' permission checks (there was no way to give them)."""
    deleted: list[str] = []

    def lead_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return f"lead: {messages[-1].content}"
        return [ToolCall(id="a", name="ask_cleaner", arguments={"task": "clean"})]

    runtime = await runtime_factory()
    worker = _cleaner(deleted, name="cleaner")
    team = Team(Agent("l", model=FunctionModel(lead_decides), runtime=runtime), [worker])
    viewer = {"role": "viewer"}
    result = await team.run("go", session_id="t", user_id="u", metadata=viewer)
    assert "permission denied" in result.output
    events = team.stream("go", session_id="t2", user_id="u", metadata=viewer)
    assert "permission denied" in (await Agent._drain(events)).output
    resumed = await team.resume("go", session_id="t", user_id="u", metadata=viewer)
    assert resumed.output == result.output
    assert deleted == []


async def test_a_workflows_step_counts_include_its_function_nodes(
    runtime_factory: Factory,
) -> None:
    """``replayed_steps`` and ``fresh_steps`` count every step of the run: a function node's
    step too (they were summed over the agent nodes only, so a resume of a workflow of
    functions reported that nothing replayed and nothing ran)."""
    runtime = await runtime_factory()
    draft = Agent("d", model=FunctionModel(lambda messages, tools: "draft"), runtime=runtime)
    flow = Workflow([("upper", str.upper), ("draft", draft), ("lower", str.lower)])
    first = await flow.run("x", session_id="s", user_id="u")
    assert (first.replayed_steps, first.fresh_steps) == (0, 3)  # two functions, one model call
    again = await flow.resume("x", session_id="s", user_id="u")
    assert (again.replayed_steps, again.fresh_steps) == (3, 0)


async def test_a_team_lead_keeps_its_governance_and_journal() -> None:
    # The lead is rebuilt with worker tools; its audit log, budget, permissions and hooks stay.
    from loomflow.audit import AuditLog, InMemoryAuditStore
    from loomflow.governance import Rule, StandardBudget, StandardPermissions
    from loomflow.runtime import InMemoryRuntime

    worked: list[str] = []

    def worker_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        worked.append(messages[-1].content)
        return f"done: {messages[-1].content}"

    def lead_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "finished"
        return [ToolCall(id="a", name="ask_helper", arguments={"task": "sort"})]

    audit = AuditLog(InMemoryAuditStore())
    budget = StandardBudget()
    permissions = StandardPermissions("default", [Rule.deny("ask_helper", reason="not today")])
    lead = Agent(
        "lead",
        model=FunctionModel(lead_decides),
        runtime=InMemoryRuntime(),
        audit=audit,
        budget=budget,
        permissions=permissions,
        max_turns=4,
    )
    team = Team(lead, [Agent("w", model=FunctionModel(worker_decides), name="helper")])
    assert team.lead.audit is audit
    assert team.lead.budget is budget
    assert team.lead.permissions is permissions
    assert team.lead.runtime is lead.runtime
    assert team.lead.max_turns == 4
    result = await team.run("go", session_id="s", user_id="ana")
    assert result.output == "finished"
    actions = [e.action for e in (await audit.query(user_id="ana")).entries]
    assert "permission.decision" in actions  # the lead's policy saw the worker call
    assert worked == []  # and refused it
    usage = await budget.store.usage("ana")
    assert sum(u.totals.calls for u in usage if u.bucket.period == "") == 2


def test_team_workers_given_as_a_generator_are_all_kept() -> None:
    # The constructor read the workers once for the name check and again to register them:
    # a generator left the lead with no worker and no ask_<name> tool, without a word.
    from loomflow.models import ScriptedModel

    lead = Agent("lead", model=ScriptedModel(["done"]), name="lead")
    workers = (Agent("w", model=ScriptedModel(["ok"]), name=n) for n in ["alpha", "beta"])
    team = Team(lead, workers)
    assert sorted(team.workers) == ["alpha", "beta"]
    assert sorted(team.lead.tools) == ["ask_alpha", "ask_beta"]


def test_architectures_refuse_bad_parts_when_built() -> None:
    # Refused by name when built, not with a TypeError when a run reaches the part (after
    # the nodes or debaters before it ran).
    from loomflow.errors import InvalidIdError, UserError

    agent = Agent("a", model=FunctionModel(lambda messages, tools: "ok"))
    with pytest.raises(UserError, match="workflow node 'publish' must be an Agent or a function"):
        Workflow([("outline", agent), ("publish", "print it")])
    with pytest.raises(UserError, match=r"workflow node 'x' must be .* not NoneType"):
        Workflow({"x": None})  # type: ignore[dict-item]
    for item in (("a", agent, "extra"), "ab", ("only",)):
        with pytest.raises(UserError, match=r"a workflow node is a \(name, node\) pair"):
            Workflow([item])  # type: ignore[list-item]
    assert Workflow([["upper", str.upper]]).nodes == [("upper", str.upper)]  # type: ignore[list-item]
    with pytest.raises(UserError, match="node's name must be a string, not 5"):
        Workflow([(5, agent)])  # type: ignore[list-item]
    with pytest.raises(InvalidIdError, match="workflow node name contains the control"):
        Workflow([("a\x00b", agent)])
    with pytest.raises(InvalidIdError, match=r"workflow node name is .* over the 2048-byte"):
        Workflow([("n" * 3000, agent)])
    with pytest.raises(UserError, match="the judge must be an Agent, not str"):
        Debate([agent], "judge")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="a debater must be an Agent, not str"):
        Debate(["pro"], agent)  # type: ignore[list-item]
    for rounds in (1.5, "2", True):
        with pytest.raises(UserError, match="rounds must be a whole number"):
            Debate([agent], agent, rounds=rounds)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="a team worker must be an Agent, not function"):
        Team(agent, [lambda task: task])  # type: ignore[list-item]
    with pytest.raises(UserError, match="the team's lead must be an Agent"):
        Team("lead", [agent])  # type: ignore[arg-type]


def test_a_team_refuses_a_worker_name_no_tool_can_carry_by_the_workers_name() -> None:
    # The worker's tool is built by the team, so "pass name=..." (Tool's own advice) is
    # advice the user cannot follow: the message names the worker and what to change.
    lead = Agent("lead", model=FunctionModel(lambda messages, tools: "ok"), name="lead")
    for name in ("billing/eu", "r\u00e9sum\u00e9", "w" * 61):
        worker = Agent("w", model=FunctionModel(lambda messages, tools: "ok"), name=name)
        with pytest.raises(UserError, match=r"team worker .* gives the lead a tool named") as err:
            Team(lead, [worker])
        assert "pass name=" not in str(err.value)
        assert "rename the worker" in str(err.value)
    assert list(Team(lead, [Agent("w", model="scripted", name="w" * 60)]).lead.tools) == [
        "ask_" + "w" * 60
    ]


async def test_a_team_run_resumed_through_its_lead_gives_workers_their_memory(
    runtime_factory: Factory,
) -> None:
    """A recovery worker resumes a crashed team run as ``team.lead.resume(...)``: the run
    records the lead's name, and ``Recovery(runtime, {"lead": team.lead})`` is how a team is
    registered. The workers' memory was only kept for runs started through the team, so the
    worker's second task came without the first exchange: its model call diverged from the
    journal and ran again (paid twice, and free to decide otherwise)."""

    class Died(BaseException):
        """Like the process dying: no tool turns it into a tool error."""

    asked: list[int] = []
    done: list[str] = []
    crash = True

    @tool
    def measure(what: str) -> str:
        """Measure something."""
        done.append(what)
        if what == "moons" and crash:
            raise Died
        return f"{what} measured"

    def worker_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return f"research: {messages[-1].content}"
        asked.append(len(messages))
        return [ToolCall(id="m", name="measure", arguments={"what": messages[-1].content})]

    def lead_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        answers = [m.content for m in messages if m.role == "tool"]
        if len(answers) < 2:
            task = ["tides", "moons"][len(answers)]
            return [ToolCall(id=f"a{len(answers)}", name="ask_w", arguments={"task": task})]
        return " | ".join(answers)

    runtime = await runtime_factory()
    team = Team(
        Agent("lead", model=FunctionModel(lead_decides), runtime=runtime, name="lead"),
        [Agent("w", model=FunctionModel(worker_decides), tools=[measure], name="w")],
    )
    with pytest.raises(Died):
        await team.run("report", session_id="s", user_id="u")
    assert asked == [2, 4]  # the second task came with the first exchange
    crash = False
    result = await team.lead.resume("report", session_id="s", user_id="u")
    assert result.output == "research: tides measured | research: moons measured"
    assert asked == [2, 4]  # the worker's model calls replayed: no new one
    assert done == ["tides", "moons", "moons"]  # only the call in flight ran again


async def test_a_prompt_that_is_no_string_is_refused_before_anything_runs(
    runtime_factory: Factory,
) -> None:
    # An agent and a team refuse it; a debate argued over "Topic: None" at the models' cost,
    # and a workflow opened its run and failed with a TypeError in its first node.
    called: list[str] = []

    def model(messages: list[Message], tools: list[ToolSpec]) -> Any:
        called.append(messages[-1].content)
        return "ok"

    def node(text: str) -> str:
        called.append(text)
        return text.upper()

    runtime = await runtime_factory()
    agent = Agent("a", model=FunctionModel(model))
    debate = Debate([agent], agent, runtime=runtime, name="debate")
    flow = Workflow([("upper", node)], runtime=runtime, name="flow")
    for prompt in (None, 123, b"bytes"):
        with pytest.raises(UserError, match="prompt must be a string"):
            await debate.run(prompt, session_id="d", user_id="u")  # type: ignore[arg-type]
        with pytest.raises(UserError, match="prompt must be a string"):
            await flow.run(prompt, session_id="w", user_id="u")  # type: ignore[arg-type]
    # Metadata that is no mapping: the InvalidArgumentTypeError an agent (and so a team's
    # lead) raises; a debate and a workflow raised a ValueError or TypeError from dict().
    team = Team(Agent("lead", model=FunctionModel(model), runtime=runtime), [])
    for metadata in ("role", ["admin"], 5):
        for built in (debate, flow, team):
            with pytest.raises(InvalidArgumentTypeError, match="metadata must be a mapping"):
                await built.run("t", session_id="m", user_id="u", metadata=metadata)  # type: ignore[arg-type]
    assert called == []
    # Nothing was journaled: the sessions run afresh.
    assert (await flow.run("x", session_id="w", user_id="u")).output == "X"
    assert (await debate.run("t", session_id="d", user_id="u")).fresh_steps > 0


@pytest.mark.parametrize("checkpoint", [False, True], ids=["replay", "snapshot"])
async def test_a_worker_asked_twice_under_one_call_id_remembers_both_answers(
    runtime_factory: Factory, checkpoint: bool
) -> None:
    """A tool call id is unique within one model answer, not across turns (scripted models
    and some servers send "a" every turn). Rebuilt from a snapshot, the worker's memory took
    the last answer to id "a" for every task asked under it, so after the resume the worker
    was told it had answered "one" with what it answered "two"."""
    seen: list[list[str]] = []

    def worker_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        seen.append([m.content for m in messages[1:]])
        return f"did {messages[-1].content}"

    crash = True

    def lead_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        asked = [m for m in messages if m.role == "tool"]
        if len(asked) == 2 and crash:
            raise Crash
        if len(asked) < 3:
            task = ("one", "two", "three")[len(asked)]
            return [ToolCall(id="a", name="ask_w", arguments={"task": task})]
        return "done"

    runtime = await runtime_factory()
    lead = Agent(
        "lead",
        model=FunctionModel(lead_decides),
        runtime=runtime,
        tuning=Tuning(checkpoint=checkpoint),
    )
    team = Team(lead, [Agent("w", model=FunctionModel(worker_decides), name="w")])
    with pytest.raises(Crash):
        await team.run("go", session_id="s", user_id="u")
    crash = False
    assert (await team.resume("go", session_id="s", user_id="u")).output == "done"
    assert seen[-1] == ["one", "did one", "two", "did two", "three"]


@pytest.fixture
async def budget_store(tmp_path: Any) -> Any:
    from loomflow.governance import SqlBudgetStore

    store = SqlBudgetStore(f"sqlite:///{tmp_path}/budget.db")
    yield store
    await store.close()


def _noting(calls: list[str], **options: Any) -> Agent:
    """An agent whose model notes each prompt it answers."""

    def answer(messages: list[Message], tools: list[ToolSpec]) -> Any:
        calls.append(messages[-1].content)
        return f"answer to {messages[-1].content}"

    return Agent("n", model=FunctionModel(answer), **options)


def _capped(calls: list[str], limit: int, store: Any) -> Agent:
    """A noting agent under a user cap of ``limit`` tokens."""
    from loomflow.governance import Cap, StandardBudget

    budget = StandardBudget([Cap("tokens_total", limit)], store=store)
    return _noting(calls, budget=budget, tuning=Tuning(max_tokens=16))


async def test_a_workflow_stops_at_a_node_a_budget_interrupted(
    runtime_factory: Factory, budget_store: Any
) -> None:
    # The node's budget:<cap> interruption was swallowed: the next node ran on an empty
    # text, and the workflow returned as finished, not interrupted.
    first: list[str] = []
    second: list[str] = []
    runtime = await runtime_factory()
    flow = Workflow(
        [("first", _capped(first, 5, budget_store)), ("second", _noting(second))],
        runtime=runtime,
    )
    result = await flow.run("go", session_id="s", user_id="u")
    assert (result.interrupted, result.interruption_reason) == (True, "budget:user.tokens_total")
    assert first == second == []
    [session] = await runtime.sessions(session_id="s")
    assert session.state == "interrupted"
    # With room in the budget, the resume continues from the node that stopped.
    flow = Workflow(
        [("first", _capped(first, 10**6, budget_store)), ("second", _noting(second))],
        runtime=runtime,
    )
    resumed = await flow.resume("go", session_id="s", user_id="u")
    assert not resumed.interrupted
    assert resumed.output == "answer to answer to go"
    assert (first, second) == (["go"], ["answer to go"])


async def test_a_debate_stops_at_a_debater_a_budget_interrupted(
    tmp_path: Any, budget_store: Any
) -> None:
    from loomflow.runtime import SqliteRuntime

    argued: list[str] = []
    judged: list[str] = []
    runtime = SqliteRuntime(tmp_path / "journal.db")
    debaters = [_noting(argued), _capped(argued, 5, budget_store)]
    debate = Debate(debaters, _noting(judged), rounds=1, runtime=runtime)
    result = await debate.run("tabs or spaces", session_id="s", user_id="u")
    assert (result.interrupted, result.interruption_reason) == (True, "budget:user.tokens_total")
    assert len(argued) == 1  # the first debater spoke; the second was refused its call
    assert judged == []
    [session] = await runtime.sessions(session_id="s")
    assert session.state == "interrupted"
    await runtime.close()


async def test_an_interrupted_sub_agent_is_a_tool_error_not_an_empty_answer(
    tmp_path: Any,
) -> None:
    # An agent used as a tool (or a team worker) that stopped at max_turns returned "" as
    # the call's result: the caller's model took it for finished work.
    from loomflow.runtime import SqliteRuntime

    @tool
    def look(q: str) -> str:
        """Look something up."""
        return "nothing yet"

    def looks_forever(messages: list[Message], tools: list[ToolSpec]) -> Any:
        return [ToolCall(id=f"l{len(messages)}", name="look", arguments={"q": "x"})]

    seen: list[Message] = []

    def lead_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        results = [m for m in messages if m.role == "tool"]
        if not results:
            return [ToolCall(id="a", name=tools[0].name, arguments={"task": "find it"})]
        seen.append(results[-1])
        return "done"

    runtime = SqliteRuntime(tmp_path / "journal.db")
    worker = Agent(
        "w", model=FunctionModel(looks_forever), tools=[look], name="finder", max_turns=2
    )
    as_tool = Agent("lead", model=FunctionModel(lead_decides), tools=[worker.as_tool()])
    team = Team(Agent("lead", model=FunctionModel(lead_decides), runtime=runtime), [worker])
    for index, lead in enumerate((as_tool.clone(runtime=runtime), team.lead)):
        seen.clear()
        result = await lead.run("go", session_id=f"s{index}", user_id="u")
        assert not result.interrupted
        [answer] = seen
        assert answer.is_error
        assert "finder agent was interrupted (max_turns)" in answer.content
    await runtime.close()


async def test_a_team_stream_closed_during_the_leads_model_call_ends_the_leads_run() -> None:
    # The team's stream did not close the lead's run it read: that run (and its model call,
    # holding a budget reservation) went on until the garbage collector closed it.
    from loomflow.agent import ModelDeltaEvent
    from loomflow.governance.budget import Bucket, Cap, InMemoryBudgetStore, StandardBudget
    from loomflow.models import OpenAIModel
    from loomflow.testing.providers import FakeOpenAIAPI, Reply

    store = InMemoryBudgetStore()
    budget = StandardBudget([Cap("tokens_total", 100_000)], store=store)
    with FakeOpenAIAPI(default=Reply(text=["word "] * 50)) as api:
        model = OpenAIModel("gpt-4o", base_url=api.base_url, api_key="test")
        lead = Agent("lead", model=model, budget=budget, memory=False, telemetry=False)
        team = Team(lead, [Agent("w", model=FunctionModel(lambda m, t: "ok"), name="helper")])
        stream = team.stream("go", session_id="s", user_id="u")
        async for event in stream:
            if isinstance(event, ModelDeltaEvent):
                break
        await stream.aclose()  # type: ignore[attr-defined]
        key = Bucket("user", "u").key
        totals = (await store.totals([key]))[key]
        await model.aclose()
    assert (totals.reserved_in, totals.reserved_out, totals.tokens_out) == (0, 0, 0)
