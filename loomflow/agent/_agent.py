"""The agent: a ReAct loop whose every model call and tool call is a journaled step.

Step names are part of the journal key and must stay stable across releases:

- ``model_call_<turn>``: one streamed model call (the provider-neutral chunks are journaled,
  so ``run()`` and ``stream()`` replay each other's calls);
- ``tool_call_<turn>_<slot>_<hash>``: one tool call, keyed by its position in the turn plus a
  hash of the tool name and arguments, never by the provider's call id. A replayed result is
  answered to the *current* call id.

- ``persist_episode_<turns>``: unless ``memory=False``, the run's own turns written as an
  episode when the run returns; idempotent (one episode per run, whatever replays or retries).

Steps that a tool makes (a sub-agent used as a tool, say) are keyed under a sub-run named after
that tool call, so resuming the outer run replays them too.

Memory and checkpoints belong to the *outermost* run of a (session, user): agents running
inside another run (tools, team workers, debaters) neither recall nor record episodes and
write no checkpoints, since they share the enclosing run's session and journal key.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel
from ulid import ULID

from .._cleanup import run_cleanup
from .._ids import check_id
from ..audit.redaction import Redactor
from ..audit.sealing import SealedValueLost, Sealer
from ..checkpoints import (
    Checkpoint,
    CheckpointRestored,
    CheckpointSaved,
    CheckpointStore,
    checkpoint_store_for,
)
from ..config import Settings
from ..context import RunContext, get_run_context, use_run_context
from ..errors import CheckpointError, CheckpointNotFoundError, UserError
from ..memory import InMemoryMemory, Memory, memory_for
from ..messages import (
    Message,
    ModelResponse,
    ModelSettings,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    Usage,
)
from ..models import Model, cost_usd, resolve_model
from ..runtime import codec
from ..runtime._journal import JournalRuntime
from ..tools import TOOL_ERROR, Tool, ToolLike, ToolOutcome, ToolRegistry
from ._passthrough import Passthrough
from ._types import (
    AgentEvent,
    ModelDeltaEvent,
    RunFinished,
    RunResult,
    RunStarted,
    ToolCallFinished,
    ToolCallStarted,
    Tuning,
)
from .hooks import Interrupt, RunHooks, RunInfo

__all__ = ["Agent"]

log = logging.getLogger("loomflow.agent")

# The runtime of the run in progress, so that agents used inside it (sub-agents, team workers,
# debaters) journal under the enclosing run even when they were built without a runtime.
_active_runtime: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "loomflow_active_runtime", default=None
)


@contextlib.asynccontextmanager
async def enclosing_run(
    runtime: Any,
    session_id: str,
    user_id: str | None,
    metadata: Mapping[str, Any] | None,
    *,
    resume: bool = False,
    strict_replay: bool | None = None,
) -> AsyncIterator[tuple[RunContext, Any]]:
    """Open a run: its RunContext, the shared runtime for agents inside it, and its journal."""
    ctx = RunContext(
        run_id=str(ULID()),
        session_id=session_id,
        user_id=user_id,
        metadata=MappingProxyType(dict(metadata or {})),
    )
    runtime_token = _active_runtime.set(runtime)
    try:
        with use_run_context(ctx):
            async with runtime.session(
                session_id, user_id, resume=resume, strict_replay=strict_replay
            ) as run:
                yield ctx, run
    finally:
        _active_runtime.reset(runtime_token)


def runtime_for(runtime: Any) -> Any:
    """The runtime a run uses: its own, else the enclosing run's, else no journal."""
    return runtime or _active_runtime.get() or Passthrough()


def tool_step_name(turn: int, slot: int, call: ToolCall) -> str:
    """The journal name of a tool call: position plus a hash of tool name and arguments."""
    digest = hashlib.sha256(codec.canonical_bytes([call.name, call.arguments])).hexdigest()
    return f"tool_call_{turn}_{slot}_{digest[:16]}"


class Agent:
    """An LLM agent whose runs survive crashes.

    Args:
        instructions: The system prompt.
        model: A :class:`~loomflow.models.Model` or a model string (``"claude-opus-4-7"``,
            ``"gpt-4.1"``, ``"scripted"``), resolved on first use.
        tools: Tools (``@tool`` functions or plain callables) the model may call.
        runtime: The journal. ``None`` journals nothing (unless the agent runs inside another
            agent's run, whose runtime it then shares).
        tuning: Loop settings (:class:`Tuning`).
        max_turns: Model calls allowed per run before it stops with ``max_turns``.
        name: A short name used in sub-run keys, spans and tool names.
        memory: Per-user memory (:class:`~loomflow.memory.Memory`): each outermost run is
            reminded of the earlier runs of its (session, user), and records its own turns
            as an episode when it returns. By default (``None``) episodes are kept beside
            the journal (``memory_for(runtime)``), or in this agent's process memory when it
            has no runtime; ``False`` keeps none.
        budget: Spending caps checked before every live model call.
        permissions: The policy checked before every live tool call.
        audit: The per-user audit log.
        guardrails: Checks on input, output and tool results.
        telemetry: Spans and metrics.
        hooks: Extra :class:`~loomflow.agent.hooks.RunHooks`. Each component above except
            memory (which the loop uses directly) is (or provides through ``as_hooks()``) a
            ``RunHooks`` too; the loop calls them in the order guardrails, budget,
            permissions, audit, telemetry, then ``hooks``.
    """

    def __init__(
        self,
        instructions: str,
        *,
        model: Model | str,
        tools: Sequence[ToolLike] = (),
        runtime: JournalRuntime | None = None,
        memory: Memory | Literal[False] | None = None,
        budget: Any = None,
        permissions: Any = None,
        audit: Any = None,
        guardrails: Sequence[Any] = (),
        telemetry: Any = None,
        tuning: Tuning | None = None,
        max_turns: int = 10,
        name: str = "agent",
        hooks: Sequence[RunHooks] = (),
    ) -> None:
        if not isinstance(instructions, str):
            raise UserError("instructions must be a string")
        if max_turns < 1:
            raise UserError(f"max_turns must be at least 1, not {max_turns}")
        if memory is not None and memory is not False and not isinstance(memory, Memory):
            raise UserError(
                f"memory must be a loomflow.memory.Memory (InMemoryMemory, SqliteMemory, "
                f"PostgresMemory, memory_for(runtime)), None for the default or False for "
                f"none, not {memory!r}"
            )
        self._memory_default = memory is None  # so that clone() can move it with the runtime
        if memory is None:
            memory = _default_memory(runtime)
        self.instructions = instructions
        self._owned: list[Any] = []  # components from_settings built, closed by aclose()
        self._model_spec = model
        self._model: Model | None = None if isinstance(model, str) else model
        self.tools = ToolRegistry(tools)
        self.runtime = runtime
        self.memory: Memory | None = memory or None
        self.budget = budget
        self.permissions = permissions
        self.audit = audit
        # Seals sensitive tool arguments before model responses are journaled (see
        # loomflow.audit.sealing); the audit log's redactor when there is one.
        self._redactor: Redactor = getattr(audit, "redactor", None) or Redactor.from_settings()
        # Sealed tool results of this agent's runs, in this process only (see Sealer).
        self._sealed_results: OrderedDict[str, str] = OrderedDict()
        self.guardrails = tuple(guardrails)
        self.telemetry = telemetry
        self.tuning = tuning or Tuning()
        self.max_turns = max_turns
        self.name = name
        self.hooks = tuple(hooks)
        # Memory is wired into the loop itself (it changes the message stack, which no hook
        # may); a memory that also offers hooks keeps its place in the order.
        memory_hooks = memory if hasattr(memory, "as_hooks") else None
        self._hooks = _collect_hooks(
            [*guardrails, budget, permissions, memory_hooks, audit, telemetry, *hooks]
        )
        self._specs = [ToolSpec(**spec) for spec in self.tools.specs()]
        self._settings = ModelSettings(
            max_tokens=self.tuning.max_tokens, temperature=self.tuning.temperature
        )

    @classmethod
    def from_settings(
        cls,
        instructions: str,
        *,
        model: Model | str,
        settings: Settings | None = None,
        caps: Sequence[Any] = (),
        **options: Any,
    ) -> Agent:
        """An agent whose journal, audit log, budget and telemetry come from :class:`Settings`.

        The journal is ``runtime_url``; memory, unless given, lives beside it (as for
        :class:`Agent`). The audit log (redacting the configured secrets) is
        ``audit_url`` and the budget's totals ``budget_url``; either, when unset, lives beside
        the journal (in its database, or in memory). The budget enforces ``caps``; with none it
        only records usage (a reservation and a commit per model call; pass ``budget=None``
        to skip it). With
        ``otlp_endpoint`` or ``metrics_port`` set, spans are exported and metrics served, once
        per process. Close what this built with :meth:`aclose` or ``async with``.

        Args:
            instructions: The system prompt.
            model: A model or model string, as for :class:`Agent`.
            settings: Defaults to ``Settings()`` (``LOOMFLOW_*`` variables and ``.env``).
            caps: :class:`~loomflow.governance.Cap` objects for the budget.
            options: Any other :class:`Agent` argument. A ``runtime``, ``audit``, ``budget``
                or ``telemetry`` given here is used as is, and left for the caller to close.

        Example:
            >>> # LOOMFLOW_RUNTIME_URL=postgresql://app@db/app LOOMFLOW_METRICS_PORT=9464
            >>> agent = Agent.from_settings("...", model="claude-opus-4-7")  # doctest: +SKIP
            >>> await agent.run("hi", session_id="s-1", user_id="ana")  # doctest: +SKIP
            >>> await agent.aclose()  # doctest: +SKIP
        """
        from ..audit import AuditLog
        from ..governance import StandardBudget
        from ..stores import Stores
        from ..telemetry import Telemetry, setup_telemetry_once

        s = settings or Settings()
        if caps and "budget" in options:
            raise UserError("pass either caps= or budget=, not both")
        owned: list[Any] = []
        # Placement is decided in one place (loomflow.stores): unless their URLs say otherwise,
        # the audit log and the budget live beside the journal actually used (sharing its
        # connection), so every worker writes to the same place. The agent closes what it took.
        given = options.get("runtime")
        stores = Stores(s, runtime=given, journal="runtime" not in options or given is not None)
        if "runtime" not in options:
            options["runtime"] = stores.runtime
            owned.append(options["runtime"])
        if "audit" not in options:
            options["audit"] = AuditLog(stores.audit, redactor=Redactor.from_settings(s))
            owned.append(options["audit"])
        if "budget" not in options:
            options["budget"] = StandardBudget(caps, store=stores.budget)
            owned.append(options["budget"])
        if "telemetry" not in options:
            if s.otlp_endpoint or s.metrics_port is not None:
                setup_telemetry_once(s)
            options["telemetry"] = Telemetry(settings=s)
        # The stores connect on first use, so a bad option below leaves nothing open.
        agent = cls(instructions, model=model, **options)
        agent._owned = owned
        return agent

    def clone(self, **changes: Any) -> Agent:
        """A new agent configured like this one, with ``changes`` (any constructor argument).

        Components (runtime, memory, budget, audit log, ...) are shared, not copied; a
        default memory follows the runtime, so ``clone(runtime=other)`` keeps its episodes
        beside ``other``. Example: ``agent.clone(tools=[*agent.tools.values(), extra_tool])``.
        """
        options: dict[str, Any] = {
            "model": self._model_spec,
            "tools": list(self.tools.values()),
            "runtime": self.runtime,
            "budget": self.budget,
            "permissions": self.permissions,
            "audit": self.audit,
            "guardrails": self.guardrails,
            "telemetry": self.telemetry,
            "tuning": self.tuning,
            "max_turns": self.max_turns,
            "name": self.name,
            "hooks": self.hooks,
        }
        options.update(changes)
        instructions = options.pop("instructions", self.instructions)
        carried = "memory" not in changes
        if carried:
            # Default memory lives beside the journal: a clone on another runtime gets its own
            # beside that one; otherwise the clone shares this agent's memory (or its absence).
            moved = self._memory_default and options["runtime"] is not self.runtime
            options["memory"] = None if moved else (self.memory or False)
        clone = type(self)(instructions, **options)
        if carried:
            clone._memory_default = self._memory_default
        return clone

    async def aclose(self) -> None:
        """Close the runtime, audit log and budget that :meth:`from_settings` built.

        Every one is closed even if another fails; the first failure is raised afterwards.
        """
        owned, self._owned = self._owned, []
        failure: BaseException | None = None
        for component in reversed(owned):
            try:
                await component.close()
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"Agent(name={self.name!r}, model={self.model.name!r}, tools={list(self.tools)})"

    @property
    def model(self) -> Model:
        """The model, resolved from its string on first use."""
        if self._model is None:
            self._model = resolve_model(self._model_spec)
        return self._model

    # -- public API ------------------------------------------------------------------------

    async def run(
        self,
        prompt: str,
        *,
        session_id: str | None = None,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> RunResult:
        """Run the agent on ``prompt`` until it answers (or is interrupted)."""
        return await self._drain(
            self.stream(prompt, session_id=session_id, user_id=user_id, metadata=metadata)
        )

    async def resume(
        self,
        prompt: str,
        *,
        session_id: str,
        user_id: str | None = None,
        from_checkpoint: str | None = None,
        fork_session_id: str | None = None,
    ) -> RunResult:
        """Continue the session's last run, finished or not.

        With ``Tuning(checkpoint=True)`` and a snapshot of that run, the snapshot is restored
        directly: no replay walk, no memory recall, prior turns neither re-run nor re-billed
        (their usage is carried into the result). Otherwise the run is replayed from the
        journal. Pass the prompt and user of the original run: the journal matches steps by
        their inputs, and a snapshot taken for another prompt is refused.

        ``from_checkpoint=<id>`` (an id from :meth:`list_checkpoints`) forks that snapshot into
        a new session (``fork_session_id``, or a fresh ULID; see ``RunResult.session_id``) and
        continues there; the original session is left untouched.

        Raises:
            CheckpointNotFoundError: ``from_checkpoint`` is not a snapshot of this
                (session, user).
            UserError: the snapshot was taken for another prompt, or checkpoints are off.
        """
        return await self._drain(
            self._events(
                prompt,
                session_id,
                user_id,
                None,
                resume=True,
                from_checkpoint=from_checkpoint,
                fork_session_id=fork_session_id,
            )
        )

    async def list_checkpoints(
        self, session_id: str, *, user_id: str | None = None
    ) -> list[Checkpoint]:
        """The snapshots of (session, user), newest first (see ``Tuning(checkpoint=True)``)."""
        if self.runtime is None:
            raise UserError("an agent without a runtime keeps no checkpoints")
        return await checkpoint_store_for(self.runtime).list_checkpoints(
            session_id, user_id=user_id
        )

    def stream(
        self,
        prompt: str,
        *,
        session_id: str | None = None,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[AgentEvent]:
        """Run the agent and yield its events; the last one is :class:`RunFinished`."""
        return self._events(prompt, session_id, user_id, metadata, resume=False)

    def as_tool(self, name: str | None = None, description: str | None = None) -> Tool[..., Any]:
        """This agent as a tool for another agent; its steps journal under the caller's run."""

        async def delegate(task: str) -> str:
            ctx = get_run_context()
            result = await self.run(
                task, session_id=ctx.session_id, user_id=ctx.user_id, metadata=ctx.metadata
            )
            return result.output

        return Tool(
            delegate,
            name=name or self.name,
            description=description or f"Ask the {self.name} agent to carry out a task.",
        )

    # -- the loop --------------------------------------------------------------------------

    @staticmethod
    async def _drain(events: AsyncIterator[AgentEvent]) -> RunResult:
        result: RunResult | None = None
        async for event in events:
            if isinstance(event, RunFinished):
                result = event.result
        assert result is not None  # every event stream ends with RunFinished
        return result

    def _runtime(self) -> Any:
        return runtime_for(self.runtime)

    async def _events(
        self,
        prompt: str,
        session_id: str | None,
        user_id: str | None,
        metadata: Mapping[str, Any] | None,
        *,
        resume: bool,
        history: Sequence[Message] = (),
        from_checkpoint: str | None = None,
        fork_session_id: str | None = None,
    ) -> AsyncIterator[AgentEvent]:
        if not isinstance(prompt, str):
            raise UserError("prompt must be a string")
        # Refused before anything runs: an empty session id must not become a fresh session
        # (a redelivered request would repeat its side effects), nor a too-long id a driver
        # error halfway through the run.
        check_id("session_id", session_id)
        check_id("user_id", user_id)
        check_id("from_checkpoint", from_checkpoint)
        check_id("fork_session_id", fork_session_id)
        runtime = self._runtime()
        outer = get_run_context()
        nested = outer.run_id is not None
        if nested:  # a sub-run inherits who it works for
            session_id = session_id if session_id is not None else outer.session_id
            user_id = user_id if user_id is not None else outer.user_id
        store = self._checkpoint_store(runtime) if self.tuning.checkpoint and not nested else None
        source: Checkpoint | None = None
        if from_checkpoint is not None:
            if store is None:
                raise UserError("from_checkpoint= needs an agent with Tuning(checkpoint=True)")
            source = await store.get(from_checkpoint, session_id=session_id or "", user_id=user_id)
            if source is None:
                raise CheckpointNotFoundError(
                    f"no checkpoint {from_checkpoint!r} in session {session_id!r} of user "
                    f"{user_id!r}"
                )
            _check_prompt(source, prompt)
            if fork_session_id == session_id:
                raise UserError("a fork needs a session id of its own")
            session_id, resume = fork_session_id or str(ULID()), False
        elif fork_session_id is not None:
            raise UserError("fork_session_id= goes with from_checkpoint=")
        if session_id is None:
            session_id = str(ULID())
        async with enclosing_run(
            runtime,
            session_id,
            user_id,
            metadata,
            resume=resume,
            strict_replay=self.tuning.strict_replay,
        ) as (ctx, run):
            restore = source
            if restore is None and resume and store is not None:
                restore = await _latest_of_run(store, ctx, run, prompt)
            yield RunStarted(run_id=ctx.run_id or "", session_id=session_id, user_id=user_id)
            async for event in self._loop(
                runtime,
                ctx,
                run,
                prompt,
                history,
                store=store,
                restore=restore,
                forked=source is not None,
                memory=None if nested else self.memory,
            ):
                yield event

    def _checkpoint_store(self, runtime: Any) -> CheckpointStore:
        if not isinstance(runtime, JournalRuntime):
            raise UserError(
                "Tuning(checkpoint=True) needs a journaled runtime (InMemoryRuntime, "
                "SqliteRuntime or PostgresRuntime): checkpoints are stored beside the journal"
            )
        return checkpoint_store_for(runtime)

    async def _loop(
        self,
        runtime: Any,
        ctx: RunContext,
        run: Any,
        prompt: str,
        history: Sequence[Message],
        *,
        store: CheckpointStore | None,
        restore: Checkpoint | None,
        forked: bool,
        memory: Memory | None,
    ) -> AsyncIterator[Any]:
        before = _counts(run)
        pending: list[BaseModel] = []
        info = RunInfo(
            ctx=ctx,
            agent_name=self.name,
            model_name=self.model.name,
            provider=self.model.provider,
            backend=getattr(runtime, "backend", "none"),
            prompt=prompt,
            epoch=getattr(run, "epoch", None),
            resumed=bool(getattr(run, "resumed", False)) or restore is not None,
            tools=self.tools,
            runtime=runtime,
            redactor=self._redactor,
            _emit=pending.append,
        )
        sealer = Sealer(self.tools, self._redactor, results=self._sealed_results)
        hooks = self._hooks

        handed: list[BaseModel] = []  # events the hooks have seen, not yet yielded

        async def to_hooks() -> None:
            # Every emitted event reaches every hook once, then (flush) the caller's stream.
            # A tool step calls this before its body runs, so the audit trail records a
            # permission decision before the tool execution it allowed.
            while pending:
                event = pending.pop(0)
                for hook in hooks:
                    await hook.on_event(info, event)
                handed.append(event)

        async def flush() -> list[BaseModel]:
            await to_hooks()
            out = handed[:]
            handed.clear()
            return out

        usage = Usage()
        cost = 0.0
        output = ""
        turns = 0
        interrupted: str | None = "max_turns"
        checking_output = False
        messages: list[Message] = []
        prompt_index = 0  # where the run's own messages start (after system prompt and history)
        answered = False  # a restored snapshot that already holds the final answer
        original_prompt = prompt  # what a later resume's prompt is compared with

        async def save(final: bool, parent_id: str | None = None) -> None:
            if store is None:
                return
            saved = await store.put(
                Checkpoint(
                    id=str(ULID()),
                    session_id=ctx.session_id or "",
                    user_id=ctx.user_id,
                    run_id=ctx.run_id or "",
                    epoch=run.epoch,
                    turn=turns,
                    final=final,
                    prompt=original_prompt,
                    output=output,
                    messages=list(messages),
                    prompt_index=prompt_index,
                    usage=usage,
                    cost_usd=round(cost, 10),
                    parent_id=parent_id,
                ),
                retention=self.tuning.checkpoint_retention,
            )
            info.emit(CheckpointSaved(checkpoint_id=saved.id, turn=turns, final=final))

        try:
            for hook in hooks:
                await hook.run_started(info)
            if restore is None:
                for hook in hooks:
                    prompt = await hook.check_input(info, prompt)
                recalled = await _recall(memory, ctx, run)
                messages = [
                    Message.system(self.instructions),
                    *recalled,
                    *history,
                    Message.user(prompt),
                ]
                prompt_index = len(messages) - 1
            else:
                # Restored, not replayed: earlier turns are neither re-run nor re-billed (no
                # hook sees them again) and memory is not consulted: the snapshot holds it all.
                original_prompt = restore.prompt
                messages = list(restore.messages)
                usage, cost, output = restore.usage, restore.cost_usd, restore.output
                turns, answered = restore.turn, restore.final
                # A fork's episode starts after the system prompt: the fork's session has no
                # episodes of its own to recall the forked history from.
                prompt_index = 1 if forked else restore.prompt_index
                info.emit(
                    CheckpointRestored(
                        checkpoint_id=restore.id,
                        turn=restore.turn,
                        forked_from=restore.session_id if forked else None,
                    )
                )
                if forked:  # the fork's own first snapshot: a crash now resumes the fork
                    await save(restore.final, parent_id=restore.id)
            for event in await flush():
                yield event
            if answered:
                interrupted = None
            # Turn numbers continue from a restored snapshot, so model_call_<turn> keys match
            # what the journal holds for this run.
            for turn in range(turns, turns if answered else self.max_turns):
                response: ModelResponse | None = None
                live = False
                tokens: list[Any] = [None] * len(hooks)

                async def call_model(
                    msgs: list[Message],
                    tools: list[ToolSpec],
                    settings: ModelSettings,
                    turn: int = turn,
                    tokens: list[Any] = tokens,
                ) -> AsyncIterator[Any]:
                    nonlocal live
                    live = True
                    for i, hook in enumerate(hooks):
                        try:
                            # What earlier hooks emitted (a budget warning) is recorded before
                            # the audit log's model.start.
                            await to_hooks()
                            tokens[i] = await hook.before_model_call(info, turn, msgs, settings)
                        except BaseException as exc:
                            # Hooks that already reserved (a budget, say) must get it back.
                            for earlier, token in zip(hooks[:i], tokens[:i], strict=True):
                                await run_cleanup(
                                    exc,
                                    "a hook's model_call_failed",
                                    earlier.model_call_failed(info, turn, exc, token),
                                )
                            raise
                    answer: ModelResponse | None = None
                    try:
                        # Hooks and the journal keep sealed tool results; the model reads them.
                        unsealed = sealer.unseal_messages(msgs)
                        stream = self.model.stream(unsealed, tools=tools, settings=settings)
                        async with contextlib.aclosing(sealer.stream(stream)) as sealed:
                            async for chunk in sealed:
                                if isinstance(chunk, ModelResponse):
                                    answer = chunk
                                yield chunk
                    except BaseException as exc:
                        for hook, token in zip(hooks, tokens, strict=True):
                            await run_cleanup(
                                exc,
                                "a hook's model_call_failed",
                                hook.model_call_failed(info, turn, exc, token),
                            )
                        raise
                    if answer is not None:
                        # Before the journal write: a response that was received and paid for
                        # is on record even if journaling it fails.
                        for hook, token in zip(hooks, tokens, strict=True):
                            await hook.model_call_finished(info, turn, answer, token=token)

                try:
                    async for chunk in runtime.stream_step(
                        f"model_call_{turn}",
                        call_model,
                        list(messages),
                        self._specs,
                        self._settings,
                    ):
                        if isinstance(chunk, ModelResponse):
                            response = chunk
                        elif isinstance(chunk, TextDelta | ToolCallDelta):
                            yield ModelDeltaEvent(turn=turn, delta=chunk, replayed=not live)
                finally:
                    for event in await flush():
                        yield event
                if response is None:
                    raise UserError(f"model {self.model.name!r} ended a stream without a response")
                for hook, token in zip(hooks, tokens, strict=True):
                    await hook.after_model_call(
                        info, turn, response, replayed=not live, token=token if live else None
                    )
                turns += 1
                usage = usage + response.usage
                cost += self._cost(response)
                messages.append(response.to_message())
                output = response.text or output
                if not response.tool_calls:
                    interrupted = None
                    await save(final=True)
                    break
                for slot, call in enumerate(response.tool_calls):
                    yield ToolCallStarted(turn=turn, slot=slot, call=call)
                calls = [
                    self._call_tool(runtime, info, turn, slot, call, sealer, to_hooks)
                    for slot, call in enumerate(response.tool_calls)
                ]
                try:
                    if self.tuning.parallel_tools:
                        outcomes = await asyncio.gather(*calls)
                    else:
                        outcomes = [await c for c in calls]
                finally:
                    for event in await flush():
                        yield event
                for slot, (call, (outcome, replayed)) in enumerate(
                    zip(response.tool_calls, outcomes, strict=True)
                ):
                    for hook in hooks:
                        await hook.after_tool_call(
                            info, turn, slot, call, outcome, replayed=replayed
                        )
                    messages.append(
                        Message.tool_result(
                            call.id, outcome.as_text(), name=call.name, is_error=not outcome.ok
                        )
                    )
                    yield ToolCallFinished(
                        turn=turn, slot=slot, call=call, outcome=outcome, replayed=replayed
                    )
                await save(final=False)
                for event in await flush():
                    yield event
            if interrupted is None:
                checking_output = True
                checked, output = output, ""  # an answer a guardrail blocks must not leave the run
                for hook in hooks:
                    checked = await hook.check_output(info, checked)
                output = checked
        except Interrupt as stop:
            interrupted = stop.reason
            if checking_output and messages and messages[-1].role == "assistant":
                messages.pop()  # the blocked answer stays out of the transcript and the episode
            for event in await flush():
                yield event
        except BaseException as exc:
            # Hooks still see what was emitted before the failure (a BudgetUnavailable, say):
            # the audit log records it before the failed run's end.
            with contextlib.suppress(Exception):
                await flush()
            for hook in hooks:  # the run's own error stays the one raised (see _cleanup)
                await run_cleanup(exc, "a hook's run_finished", hook.run_finished(info, None, exc))
            raise
        if memory is not None:
            try:
                await _persist_episode(
                    runtime, memory, ctx, run, messages[prompt_index:], output, self._redactor
                )
            except BaseException as exc:
                for hook in hooks:
                    await run_cleanup(
                        exc, "a hook's run_finished", hook.run_finished(info, None, exc)
                    )
                raise
        hits, misses = _counts(run)
        result = RunResult(
            output=output,
            turns=turns,
            tokens_in=usage.input_tokens,
            tokens_out=usage.output_tokens,
            cost_usd=round(cost, 10),
            session_id=ctx.session_id or "",
            run_id=ctx.run_id or "",
            interrupted=interrupted is not None,
            interruption_reason=interrupted,
            messages=messages,
            replayed_steps=hits - before[0],
            fresh_steps=misses - before[1],
            restored_from=restore.id if restore is not None else None,
        )
        for hook in hooks:
            await hook.run_finished(info, result, None)
        for event in await flush():
            yield event
        yield RunFinished(result=result)

    async def _call_tool(
        self,
        runtime: Any,
        info: RunInfo,
        turn: int,
        slot: int,
        call: ToolCall,
        sealer: Sealer,
        to_hooks: Callable[[], Awaitable[None]],
    ) -> tuple[ToolOutcome, bool]:
        step_name = tool_step_name(turn, slot, call)
        live = False

        async def invoke(tool_name: str, arguments: dict[str, Any]) -> ToolOutcome:
            nonlocal live
            live = True
            executed = False
            try:
                current = sealer.unseal(call)  # the real values, for this invocation only
            except SealedValueLost as lost:
                outcome = sealer.lost(lost)
            else:
                answer: ToolOutcome | None = None
                for hook in self._hooks:
                    checked = await hook.before_tool_call(
                        info, turn, slot, current, self.tools.get(tool_name)
                    )
                    if isinstance(checked, ToolOutcome):
                        answer = checked  # denied (or answered) without running the tool
                        break
                    current = checked
                await to_hooks()  # the decisions just emitted, before what they decided
                if answer is not None:
                    outcome = answer
                else:
                    # Announced before the body runs: a crash inside it still leaves a trace.
                    for hook in self._hooks:
                        await hook.tool_started(info, turn, slot, call, step_name)
                    executed = True
                    with runtime.subrun(step_name):  # steps the tool makes key under this call
                        outcome = await self._invoke(current.name, current.arguments)
                for hook in self._hooks:
                    outcome = await hook.check_tool_result(info, turn, slot, call, outcome)
            # Journaled and shown to hooks without secrets, and sealed if the tool says so.
            outcome = sealer.seal_result(call.name, sealer.scrub(outcome))
            outcome = _fit_payload(outcome, call.name, runtime)  # small enough to journal
            for hook in self._hooks:
                await hook.tool_finished(
                    info, turn, slot, call, outcome, step=step_name, executed=executed
                )
            return outcome

        outcome = await runtime.step(step_name, invoke, call.name, call.arguments)
        return outcome, not live

    async def _invoke(self, tool_name: str, arguments: dict[str, Any]) -> ToolOutcome:
        tool = self.tools.get(tool_name)
        if tool is None or self.tuning.tool_timeout is None or tool.timeout is not None:
            return await self.tools.invoke(tool_name, arguments)
        try:
            async with asyncio.timeout(self.tuning.tool_timeout):
                return await tool.invoke(arguments)
        except TimeoutError:
            return ToolOutcome(
                ok=False,
                error_type="timeout",
                error=f"tool {tool_name!r} took longer than {self.tuning.tool_timeout:g}s",
            )

    def _cost(self, response: ModelResponse) -> float:
        model_name = response.model or self.model.name
        # A budget's own price table (its prices= overrides) is what the run is charged at.
        prices = getattr(self.budget, "prices", None)
        if not isinstance(prices, Mapping):
            prices = None
        value = cost_usd(model_name, response.usage, provider=self.model.provider, prices=prices)
        if value is None:
            _warn_unpriced(model_name)
            return 0.0
        return value


def _fit_payload(outcome: ToolOutcome, tool_name: str, runtime: Any) -> ToolOutcome:
    """A result over the journal's size cap becomes a tool error the model reads.

    Raising instead would fail the run with the tool's side effects done but unrecorded, and
    every resume would run the tool again and fail the same way. The error is journaled like
    any result, so a resume replays it and the tool runs once.
    """
    limit = getattr(runtime, "max_payload_bytes", None)
    if not isinstance(limit, int):
        return outcome  # no journal, no cap
    try:
        size = len(codec.dumps(outcome))
    except codec.UnsupportedValueError:
        return outcome  # the journal reports it with the step's name
    if size <= limit:
        return outcome
    log.warning("tool %r returned %d bytes, over the %d-byte journal cap", tool_name, size, limit)
    return ToolOutcome(
        ok=False,
        error_type=TOOL_ERROR,
        error=f"tool {tool_name!r} returned {size} bytes, more than the {limit} bytes a step "
        "may store (max_payload_bytes); ask it for less (a narrower query, a page, a summary)",
    )


def _default_memory(runtime: JournalRuntime | None) -> Memory:
    """The memory of an agent built without ``memory=``: beside its journal, else in process.

    Sharing the journal's storage keeps a session's episodes wherever its runs can be resumed
    (every worker on one database sees them), and erasing or exporting a user's data there
    covers them.
    """
    if runtime is None:
        return InMemoryMemory()
    try:
        return memory_for(runtime)
    except UserError:
        # A journal memory cannot live beside (a runtime of your own): this process keeps it.
        log.warning(
            "no memory store is known beside %s; session episodes are kept in this process "
            "only (pass memory= to choose, or memory=False for none)",
            type(runtime).__name__,
        )
        return InMemoryMemory()


def _collect_hooks(components: Sequence[Any]) -> list[RunHooks]:
    hooks: list[RunHooks] = []
    for component in components:
        if component is None:
            continue
        hook = component.as_hooks() if hasattr(component, "as_hooks") else component
        if not isinstance(hook, RunHooks):
            raise UserError(
                f"{type(component).__name__} cannot plug into the agent loop: it is not a "
                "RunHooks and has no as_hooks()"
            )
        hooks.append(hook)
    return hooks


_unpriced: set[str] = set()


def _warn_unpriced(model_name: str) -> None:
    if model_name not in _unpriced:
        _unpriced.add(model_name)
        log.warning("no price known for model %r; its cost counts as 0", model_name)


def _counts(run: Any) -> tuple[int, int]:
    stats = getattr(run, "stats", None)
    return (stats.hits, stats.misses) if stats is not None else (0, 0)


def _check_prompt(checkpoint: Checkpoint, prompt: str) -> None:
    if checkpoint.prompt != prompt:
        raise UserError(
            f"checkpoint {checkpoint.id} of session {checkpoint.session_id!r} was taken for "
            f"the prompt {checkpoint.prompt[:60]!r}, not {prompt[:60]!r}: resume with the "
            "original prompt, or use run() for a new request"
        )


async def _latest_of_run(
    store: CheckpointStore, ctx: RunContext, run: Any, prompt: str
) -> Checkpoint | None:
    """The newest snapshot, if it belongs to the run being resumed; else journal replay.

    A snapshot of an *earlier* epoch is not this run's: the last run crashed before its first
    pass ended, so its journal, not an older transcript, says where it stands.
    """
    try:
        latest = await store.latest(ctx.session_id or "", user_id=ctx.user_id)
    except CheckpointError:
        if getattr(run, "strict", False):
            raise
        log.warning(
            "the latest checkpoint of session %r cannot be read; replaying the journal instead",
            ctx.session_id,
            exc_info=True,
        )
        return None
    if latest is None or latest.epoch != getattr(run, "epoch", None):
        return None
    _check_prompt(latest, prompt)
    return latest


async def _recall(memory: Memory | None, ctx: RunContext, run: Any) -> list[Message]:
    """What memory reminds a run of: the episodes of *earlier* runs of (session, user).

    Only runs journaled at a lower epoch than this one count. A run that is replayed, even
    after it finished and recorded its own episode, therefore recalls exactly what it recalled
    the first time, so its first model call has the same inputs and replays.
    """
    if memory is None or ctx.session_id is None:
        return []
    epoch = getattr(run, "epoch", None)  # None without a journal: every episode is earlier
    return await memory.history(ctx.session_id, user_id=ctx.user_id, before_epoch=epoch)


async def _persist_episode(
    runtime: Any,
    memory: Memory,
    ctx: RunContext,
    run: Any,
    own: list[Message],
    output: str,
    redactor: Redactor,
) -> None:
    """Record the run's turns as an episode, in a journaled step with a per-run key.

    The key names the run's position in the journal (session, user, epoch), not its run id, so
    a replay or a retry after a crash between the write and its journal entry lands on the
    same episode: the store replaces it instead of adding one. Replayed with the same inputs,
    the step is a journal hit and memory is not touched at all.

    Secrets are redacted from what is stored (tool arguments and results are already sealed
    and scrubbed; a prompt may still hold a key). That happens inside the step, so the step's
    inputs, and with them its journal key, do not depend on what the redactor has learned.
    """
    own = _answered(own)
    if not own or ctx.session_id is None:
        return
    epoch = getattr(run, "epoch", None)
    # Without a journal there is no replay: the run id is as stable as the run.
    position: list[Any] = ["epoch", epoch] if epoch is not None else ["run", ctx.run_id]
    key = json.dumps([ctx.session_id, ctx.user_id, *position], ensure_ascii=False)

    async def write(key: str, messages: list[Message], output: str) -> str:
        episode = await memory.record_episode(
            ctx.session_id or "",
            user_id=ctx.user_id,
            key=key,
            messages=[_redacted(m, redactor) for m in messages],
            output=redactor.text(output),
            run_id=ctx.run_id,
            epoch=epoch,
        )
        return episode.id

    turns = sum(1 for m in own if m.role == "assistant")
    await runtime.step(f"persist_episode_{turns}", write, key, own, output)


def _redacted(message: Message, redactor: Redactor) -> Message:
    calls = [
        c.model_copy(update={"arguments": redactor.value(c.arguments)}) for c in message.tool_calls
    ]
    return message.model_copy(
        update={"content": redactor.text(message.content), "tool_calls": calls}
    )


def _answered(messages: list[Message]) -> list[Message]:
    """Drop a trailing tool request whose results never came (the run was interrupted).

    Providers refuse a transcript with an unanswered tool call, and this one will be sent
    back to the model by the next run on the session.
    """
    out = list(messages)
    while out and out[-1].role == "assistant" and out[-1].tool_calls:
        out.pop()
    return out
