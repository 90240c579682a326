"""Architectures built from agents: a team with persistent workers, a debate, a workflow.

Each journals under the enclosing run: the agents inside are sub-runs keyed by a stable name
(worker tool call, debater and round, workflow node), so resuming the outer run replays them.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from ulid import ULID

from .._ids import check_id, check_key
from ..checkpoints import CheckpointRestored, checkpoint_store_for
from ..context import get_run_context
from ..errors import UserError
from ..messages import Message
from ..redaction import Redactor
from ..runtime import RunRecord, Runtime
from ..runtime._journal import JournalRun, JournalRuntime
from ..tools import Tool
from ._agent import (
    Agent,
    answer_of,
    enclosing_ids,
    enclosing_run,
    run_record,
    runtime_for,
    stored_inputs,
    stored_metadata,
)
from ._arguments import check_metadata
from ._types import AgentEvent, RunResult, ToolCallFinished

__all__ = ["Debate", "Team", "Workflow"]


def _ids(session_id: str | None, user_id: str | None) -> tuple[str, str | None]:
    """The session and user an architecture's run works for.

    Inside another run (used from a tool, say) ids left out are the enclosing run's, as for
    an agent: a fresh session id would name the sub-run differently on every attempt, so a
    resume of the enclosing run would replay none of it. Elsewhere a missing session id is
    a fresh one; an empty id is refused, not replaced (see loomflow._ids).
    """
    check_id("user_id", user_id)
    check_id("session_id", session_id)
    nested, outer_session, outer_user = enclosing_ids()
    if nested:
        session_id = session_id if session_id is not None else outer_session
        user_id = user_id if user_id is not None else outer_user
    return session_id or str(ULID()), user_id


def _combine(
    results: Sequence[RunResult], final: RunResult, *, session_id: str, run_id: str
) -> RunResult:
    return final.model_copy(
        update={
            "turns": sum(r.turns for r in results),
            "tokens_in": sum(r.tokens_in for r in results),
            "tokens_out": sum(r.tokens_out for r in results),
            "cost_usd": round(sum(r.cost_usd for r in results), 10),
            "session_id": session_id,
            "run_id": run_id,
        }
    )


class Team:
    """A lead agent that hands tasks to persistent workers, exposed to it as tools.

    A worker remembers, within one run, the tasks it was given and its answers; the memory is
    rebuilt from the lead's journaled tool results (or, when the lead resumes from a
    checkpoint, from the snapshot's transcript), so a resumed run gives the worker the same
    history it had before the crash. That holds for every run of :attr:`lead` too, so a
    recovery worker with ``team.lead`` registered under its name resumes team runs.
    """

    def __init__(self, lead: Agent, workers: Sequence[Agent]) -> None:
        _check_agent("the team's lead", lead)
        workers = list(workers)  # read once: a generator would be spent by the name check
        for worker in workers:
            _check_agent("a team worker", worker)
        names = [w.name for w in workers]
        if len(set(names)) != len(names):
            raise UserError(f"team workers need distinct names, got {names}")
        self.workers = {w.name: w for w in workers}
        # run id -> worker -> (task, answer) pairs seen so far in that run
        self._history: dict[str, dict[str, list[tuple[str, str]]]] = {}
        tools = [self._worker_tool(w) for w in workers]
        # The lead keeps all of its own configuration (journal, budget, permissions, audit,
        # guardrails, telemetry, memory, hooks); it only gains a tool per worker.
        self.lead = lead.clone(tools=[*lead.tools.values(), *tools])
        # Every run of the lead keeps the workers' memory, not only those started through the
        # team: a recovery worker resumes a crashed team run as `team.lead.resume(...)` (the
        # run records the lead's name), and its workers must see the history they saw first,
        # or their model calls diverge from the journal and run again.
        self._lead_events = self.lead._events
        vars(self.lead)["_events"] = self._tracked_events

    @staticmethod
    def tool_name(worker: str) -> str:
        return f"ask_{worker}"

    def _worker_tool(self, worker: Agent) -> Tool[..., Any]:
        async def ask(task: str) -> str:
            ctx = get_run_context()
            pairs = self._history.get(ctx.run_id or "", {}).get(worker.name, [])
            history: list[Message] = []
            for past_task, answer in pairs:
                history += [Message.user(past_task), Message.assistant(answer)]
            events = worker._events(
                task, ctx.session_id, ctx.user_id, ctx.metadata, resume=False, history=history
            )
            return answer_of(worker.name, await Agent._drain(events))

        name = self.tool_name(worker.name)
        try:
            return Tool(
                ask,
                name=name,
                description=f"Give the {worker.name} worker a task; it remembers earlier ones.",
            )
        except UserError:
            # Only the name can be refused here, and Tool's advice ("pass name=...") is not
            # the user's to follow: the team builds this tool from the worker's name.
            raise UserError(
                f"team worker {worker.name!r} gives the lead a tool named {name!r}, which model "
                "APIs refuse (1-64 letters, digits, '_' or '-'): rename the worker"
            ) from None

    async def run(
        self,
        prompt: str,
        *,
        session_id: str | None = None,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> RunResult:
        """A run of the lead; ``metadata`` (its roles, say) is the run's, and its workers'."""
        return await Agent._drain(
            self.stream(prompt, session_id=session_id, user_id=user_id, metadata=metadata)
        )

    async def resume(
        self,
        prompt: str,
        *,
        session_id: str,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> RunResult:
        """Continue the lead's run; without ``metadata`` it keeps the one it was started with."""
        events = self.lead._events(prompt, session_id, user_id, metadata, resume=True)
        return await Agent._drain(events)

    def stream(
        self,
        prompt: str,
        *,
        session_id: str | None = None,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[AgentEvent]:
        return self.lead._events(prompt, session_id, user_id, metadata, resume=False)

    async def _tracked_events(
        self,
        prompt: str,
        session_id: str | None,
        user_id: str | None,
        metadata: Mapping[str, Any] | None,
        **options: Any,
    ) -> AsyncIterator[AgentEvent]:
        """A run of the lead, recording each worker's tasks and answers as it goes."""
        run_id: str | None = None
        try:
            # Closed with this stream: the lead's run ends when the team's stream does.
            events = self._lead_events(prompt, session_id, user_id, metadata, **options)
            async with contextlib.aclosing(events) as lead_events:
                async for event in lead_events:
                    if run_id is None:
                        run_id = getattr(event, "run_id", None)
                        self._history[run_id or ""] = {}
                    if isinstance(event, CheckpointRestored):
                        # Earlier turns come back from a snapshot, without ToolCallFinished events:
                        # the workers' memory is rebuilt from the snapshot's transcript instead.
                        self._history[run_id or ""] = await self._restored_history(
                            event.checkpoint_id, session_id, user_id
                        )
                    if isinstance(event, ToolCallFinished) and event.outcome.ok:
                        worker = event.call.name.removeprefix("ask_")
                        if event.call.name == self.tool_name(worker) and worker in self.workers:
                            self._history[run_id or ""].setdefault(worker, []).append(
                                (str(event.call.arguments.get("task", "")), event.outcome.as_text())
                            )
                    yield event
        finally:
            self._history.pop(run_id or "", None)

    async def _restored_history(
        self, checkpoint_id: str, session_id: str | None, user_id: str | None
    ) -> dict[str, list[tuple[str, str]]]:
        runtime = self.lead.runtime
        if session_id is None or not isinstance(runtime, JournalRuntime):
            return {}
        snapshot = await checkpoint_store_for(runtime).get(
            checkpoint_id, session_id=session_id, user_id=user_id
        )
        if snapshot is None:
            return {}
        history: dict[str, list[tuple[str, str]]] = {}
        messages = snapshot.messages
        for at, message in enumerate(messages):
            if not message.tool_calls:
                continue
            # A call id is unique within one answer only (a model may send "a" every turn):
            # a call is answered by the tool results that follow its own answer.
            answers: dict[str | None, str] = {}
            for reply in messages[at + 1 :]:
                if reply.role != "tool":
                    break
                if not reply.is_error:
                    answers.setdefault(reply.tool_call_id, reply.content)
            for call in message.tool_calls:
                worker = call.name.removeprefix("ask_")
                asked = call.name == self.tool_name(worker) and worker in self.workers
                if asked and call.id in answers:
                    task = str(call.arguments.get("task", ""))
                    history.setdefault(worker, []).append((task, answers[call.id]))
        return history


def team_hint(value: object) -> str:
    """What to register instead, for a :class:`Team` given to a recoverer: its runs are its
    lead's (they record the lead's name), so the lead is what resumes them."""
    if isinstance(value, Team):
        return f"; a Team's runs are its lead's: register team.lead as {value.lead.name!r}"
    return ""


class _Recoverable:
    """What lets a recovery worker resume a debate's or a workflow's run, as it does an
    agent's: given a ``name``, each run records it with a fingerprint of the configuration
    and its inputs (see :class:`~loomflow.recovery.Recovery`). Without a name a run records
    nothing, and one whose process died stays ``orphaned`` until the application resumes it.
    """

    name: str | None
    runtime: JournalRuntime | None
    _inferred: bool

    def _name_and_redactor(self, name: str | None) -> None:
        if name is not None:
            check_id("name", name, optional=False)
        self.name = name
        # Checks the recorded prompt for secrets, which are never journaled; and what a
        # recovery worker notes of a failed attempt.
        self.redactor = Redactor.from_settings()

    def _shape(self) -> dict[str, Any]:
        raise NotImplementedError

    def config_fingerprint(self) -> str:
        """A digest of what shapes this run's steps (its agents' own fingerprints, node names
        and functions, rounds); a recoverer refuses a run recorded under another one."""
        shape = json.dumps(self._shape(), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(shape.encode("utf-8", "surrogatepass")).hexdigest()

    def default_output_contract(self) -> None:
        return None  # no output_type: the final text is the output

    async def run(
        self,
        prompt: str,
        *,
        session_id: str | None = None,
        user_id: str | None = None,
        resume: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> RunResult:
        """Run on ``prompt`` (a debate's topic) as one journaled run of ``session_id``."""
        # Refused before the run opens, as an agent refuses it: a debate would argue over
        # "None" at the models' cost, a workflow would fail in its first node.
        if not isinstance(prompt, str):
            raise UserError(f"prompt must be a string, not {type(prompt).__name__}")
        check_metadata(metadata)
        nested = enclosing_ids()[0]  # a sub-run: the run around it records how it ends
        # Built without runtime=, inside another run: under that run, as documented.
        runtime = runtime_for(None if nested and self._inferred else self.runtime)
        session_id, user_id = _ids(session_id, user_id)
        if resume and metadata is None and not nested and isinstance(runtime, JournalRuntime):
            # The run's own metadata (its roles, say), as an agent's resume and a recoverer
            # use it: without it the nodes would be decided on as some other caller's.
            metadata = stored_metadata(
                await stored_inputs(runtime, session_id, user_id, for_metadata=True)
            )
        record = self._record(runtime, prompt, metadata)
        async with enclosing_run(
            runtime, session_id, user_id, metadata, resume=resume, record=record
        ) as (ctx, run):
            # Every step of the run is counted, a function node's too, not only the agents'
            # (a sub-run's steps count in the run it belongs to: hence the difference).
            before = (run.stats.hits, run.stats.misses) if run is not None else (0, 0)
            results, final = await self._play(runtime, prompt)
            if final.interrupted and isinstance(run, JournalRun) and not nested:
                # As an agent's run: an interrupted run stays resumable, not finished.
                run.outcome = "interrupted"
            combined = _combine(results, final, session_id=session_id, run_id=ctx.run_id or "")
            if run is None:
                return combined
            replayed, fresh = run.stats.hits - before[0], run.stats.misses - before[1]
            return combined.model_copy(update={"replayed_steps": replayed, "fresh_steps": fresh})

    async def _play(self, runtime: Runtime, prompt: str) -> tuple[list[RunResult], RunResult]:
        """The sub-runs' results and the final one, inside the open run."""
        raise NotImplementedError

    async def resume(
        self,
        prompt: str,
        *,
        session_id: str,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> RunResult:
        """Continue the run on ``session_id``: what it journaled replays, the rest runs.
        Without ``metadata=``, the run's own (its run record's) is used, as for an agent."""
        return await self.run(
            prompt, session_id=session_id, user_id=user_id, resume=True, metadata=metadata
        )

    def _record(
        self, runtime: object, prompt: str, metadata: Mapping[str, Any] | None
    ) -> RunRecord | None:
        if self.name is None or not isinstance(runtime, JournalRuntime) or enclosing_ids()[0]:
            return None  # a sub-run is resumed with the run around it
        return run_record(self.name, self.config_fingerprint(), self.redactor, prompt, metadata)


class Debate(_Recoverable):
    """Debaters argue in rounds, each seeing the arguments so far; a judge decides."""

    def __init__(
        self,
        debaters: Sequence[Agent],
        judge: Agent,
        *,
        rounds: int = 2,
        runtime: JournalRuntime | None = None,
        name: str | None = None,
    ) -> None:
        debaters = list(debaters)
        if not debaters:
            raise UserError("a debate needs at least one debater")
        for debater in debaters:
            _check_agent("a debater", debater)
        _check_agent("the judge", judge)
        if not isinstance(rounds, int) or isinstance(rounds, bool):
            raise UserError(f"rounds must be a whole number, not {rounds!r}")
        if rounds < 1:
            raise UserError("a debate needs at least one round")
        self.debaters = list(debaters)
        self.judge = judge
        self.rounds = rounds
        self.runtime = runtime if runtime is not None else _journal_of([*debaters, judge])
        self._inferred = runtime is None  # a sub-run of another run journals under it
        self._name_and_redactor(name)

    def _shape(self) -> dict[str, Any]:
        return {
            "debate": [d.config_fingerprint() for d in self.debaters],
            "judge": self.judge.config_fingerprint(),
            "rounds": self.rounds,
        }

    async def _play(self, runtime: Runtime, topic: str) -> tuple[list[RunResult], RunResult]:
        results: list[RunResult] = []
        transcript: list[str] = []
        for round_no in range(self.rounds):
            for index, debater in enumerate(self.debaters):
                prompt = _debate_prompt(topic, transcript, round_no)
                with runtime.subrun(f"debater:{index}:{debater.name}:round{round_no}"):
                    result = await debater.run(prompt, metadata=_metadata())
                results.append(result)
                if result.interrupted:  # a budget cap, a guardrail: the debate stops there
                    return results, result
                transcript.append(f"{debater.name}: {result.output}")
        with runtime.subrun("judge"):
            verdict = await self.judge.run(
                f"Topic: {topic}\n\nArguments:\n"
                + "\n".join(transcript)
                + "\n\nDecide which position is strongest and why.",
                metadata=_metadata(),
            )
        results.append(verdict)
        return results, verdict


def _journal_of(agents: Sequence[Agent]) -> JournalRuntime | None:
    """The runtime of a debate or workflow built without one: its first agent's journal.
    Without it the run would be journaled nowhere, and each agent, run as a sub-run of a run
    that keeps nothing, would open a new run of its own on every attempt, so a resume would
    call (and pay) every finished agent's model again."""
    return next((a.runtime for a in agents if isinstance(a.runtime, JournalRuntime)), None)


def _metadata() -> Mapping[str, Any]:
    """The open run's metadata, for an agent run inside it (a debater, an agent node): its
    roles decide that agent's permissions too, as they do a team worker's or a sub-agent's."""
    return get_run_context().metadata


def _check_agent(what: str, value: object) -> None:
    if not isinstance(value, Agent):
        raise UserError(f"{what} must be an Agent, not {type(value).__name__}")


def _debate_prompt(topic: str, transcript: list[str], round_no: int) -> str:
    if not transcript:
        return f"Topic: {topic}\nGive your opening argument."
    return (
        f"Topic: {topic}\nRound {round_no + 1}. Arguments so far:\n"
        + "\n".join(transcript)
        + "\nRespond to them."
    )


Node = Agent | Callable[[str], Awaitable[str] | str]


class Workflow(_Recoverable):
    """Nodes run in order, each on the previous node's output.

    Agent nodes run as sub-runs named after the node; function nodes are journaled steps.
    """

    def __init__(
        self,
        nodes: Sequence[tuple[str, Node]] | Mapping[str, Node],
        *,
        runtime: JournalRuntime | None = None,
        name: str | None = None,
    ) -> None:
        items = list(nodes.items()) if isinstance(nodes, Mapping) else list(nodes)
        for item in items:
            if not isinstance(item, tuple | list) or len(item) != 2:
                raise UserError(f"a workflow node is a (name, node) pair, not {item!r:.80}")
        items = [(node_name, node) for node_name, node in items]
        names = [node_name for node_name, _ in items]
        if not items or len(set(names)) != len(names):
            raise UserError(f"a workflow needs nodes with distinct names, got {names}")
        for node_name, node in items:
            # Refused here rather than when the run reaches the node, after the nodes before
            # it ran. The name keys the node's step or sub-run: the journal's rule for names.
            if not isinstance(node_name, str):
                raise UserError(f"a workflow node's name must be a string, not {node_name!r}")
            check_key("workflow node name", f"node:{node_name}")
            if not isinstance(node, Agent) and not callable(node):
                raise UserError(
                    f"workflow node {node_name!r} must be an Agent or a function of the previous "
                    f"node's text, not {type(node).__name__}"
                )
        self.nodes = items
        agents = [node for _, node in items if isinstance(node, Agent)]
        self.runtime = runtime if runtime is not None else _journal_of(agents)
        self._inferred = runtime is None  # a sub-run of another run journals under it
        self._name_and_redactor(name)

    def _shape(self) -> dict[str, Any]:
        return {
            "workflow": [
                [name, node.config_fingerprint() if isinstance(node, Agent) else _qualname(node)]
                for name, node in self.nodes
            ]
        }

    async def _play(self, runtime: Runtime, prompt: str) -> tuple[list[RunResult], RunResult]:
        results: list[RunResult] = []
        text = prompt
        for name, node in self.nodes:
            if isinstance(node, Agent):
                with runtime.subrun(f"node:{name}"):
                    result = await node.run(text, metadata=_metadata())
                results.append(result)
                if result.interrupted:  # the next node would work on no answer
                    return results, result
                text = result.output
            else:
                text = str(await runtime.step(f"node:{name}", _bind(node), text))
        # The totals and ids are filled in from the sub-runs and the open run (_combine).
        final = RunResult(
            output=text, turns=0, tokens_in=0, tokens_out=0, cost_usd=0.0, session_id="", run_id=""
        )
        return results, final


def _qualname(fn: Callable[..., Any]) -> str:
    """A function node by its name: its code cannot be digested portably, and its module is
    ``__main__`` in a script but the module's own name in the worker that imports it."""
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)


def _bind(node: Callable[[str], Any]) -> Callable[[str], Awaitable[Any]]:
    # The function itself is not a journal input (it has no encoding); only the text is.
    async def call(text: str) -> Any:
        result = node(text)
        if inspect.isawaitable(result):
            result = await result
        return result

    return call
