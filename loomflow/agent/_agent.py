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

The loop itself is ``_run._Run``: one object per run, its passes as methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import logging
import weakref
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

from pydantic import BaseModel
from ulid import ULID

from .._ids import check_id, user_label
from .._json import valid_line
from .._locks import drop_if_idle
from ..checkpoints import Checkpoint, CheckpointStore, checkpoint_store_for
from ..config import Settings
from ..context import (
    RunContext,
    get_run_context,
    in_own_context,
    own_context,
    reset_var,
    use_run_context,
)
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptEntryError,
    NewerEntryError,
    SessionExistsError,
    StoreUnavailableError,
    SubAgentInterruptedError,
    UserError,
)
from ..governance.approvals import DecisionLike, PendingApproval
from ..hooks import RunHooks
from ..memory import InMemoryMemory, Memory, memory_for
from ..messages import Message, ModelSettings, ToolSpec
from ..models import Model, resolve_model
from ..models.pricing import ModelPrice
from ..redaction import Redactor, install_log_redaction
from ..runtime import OpenRun, RunRecord, Runtime, codec
from ..runtime._journal import JournalRun, JournalRuntime, run_in_context
from ..runtime._names import tool_step_name as tool_step_name  # re-exported for the CLI
from ..tools import Tool, ToolLike, ToolRegistry
from ._approvals import decide, pending_of
from ._arguments import (
    check_list,
    check_max_turns,
    check_metadata,
    check_plugin,
    check_runtime,
    check_tuning,
)
from ._output import StructuredOutput, check_output_retries, check_output_type
from ._passthrough import Passthrough
from ._run import _Run, check_prompt, contract_mismatch, inconsistency, latest_of_run
from ._sealing import SealedArguments
from ._seams import HookProvider, RedactingAudit, RunPlugin, hooks_of
from ._types import AgentEvent, RunFinished, RunResult, RunStarted, Tuning

if TYPE_CHECKING:
    from ..telemetry import Metrics

__all__ = ["Agent"]

OutputModel = TypeVar("OutputModel", bound=BaseModel)

log = logging.getLogger("loomflow.agent")

RECORD_WITHHELD = "withheld"
"""Key of a run record naming inputs kept out of the journal because they held a secret (or,
for metadata, a value the journal cannot encode)."""
RECORD_OUTPUT = "output"
"""Key of a run record describing the run's structured output (see :func:`output_contract`)."""
RECORD_FORK = "fork"
"""Key of a fork's run record naming the checkpoint it was forked from (its session and id)."""


def output_contract(structured: StructuredOutput) -> dict[str, Any]:
    """A run's output contract as its record stores it: type name, format digest, retries."""
    return {
        "type": structured.type.__qualname__,
        "format": structured.digest,
        "retries": structured.retries,
    }


# The runtime of the run in progress, so that agents used inside it (sub-agents, team workers,
# debaters) journal under the enclosing run even when they were built without a runtime.
_active_runtime: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "loomflow_active_runtime", default=None
)


def run_record(
    name: str,
    config: str,
    redactor: Redactor,
    prompt: str,
    metadata: Mapping[str, Any] | None,
    structured: StructuredOutput | None = None,
    fork: Checkpoint | None = None,
) -> RunRecord:
    """What a recoverer needs to resume a run of ``name`` (an agent, or a workflow or debate
    given a name) without its caller; ``fork`` is the snapshot a fork's run continues."""
    # The journal never holds a secret the redactor recognises (the canary tests), and a
    # redacted prompt would resume as another run (its steps' fingerprints differ). So a
    # prompt or metadata holding one is withheld: the record says so, and a recoverer
    # leaves the run to the application instead of resuming it with the wrong inputs.
    inputs: dict[str, Any] = {}
    withheld: list[str] = []
    if redactor.contains_secret(prompt):
        withheld.append("prompt")
    else:
        inputs["prompt"] = prompt
    if metadata:
        try:
            if redactor.contains_secret(codec.dumps(dict(metadata)).decode()):
                withheld.append("metadata")
            else:
                inputs["metadata"] = dict(metadata)
        except codec.UnsupportedValueError:
            # The run goes ahead, but the metadata (its roles, say) is withheld as a secret's
            # is: a recovery or resume without it would decide the run as some other caller's.
            log.warning("run metadata has no journal encoding; it is not kept for recovery")
            withheld.append("metadata")
    if withheld:
        inputs[RECORD_WITHHELD] = withheld
    if structured is not None:
        # The output format keys the run's model calls, and a class cannot be stored (a
        # recoverer never imports): its digest lets a recoverer check the agent it resumes
        # with asks for the same format (see output_contract).
        inputs[RECORD_OUTPUT] = output_contract(structured)
    if fork is not None:
        # The fork's first snapshot is a write of its own after this record's: a resume
        # that finds none seeds the fork from here, not from the prompt (see _fork_reseed).
        inputs[RECORD_FORK] = {"session_id": fork.session_id, "checkpoint": fork.id}
    return RunRecord(name, config, inputs)


async def stored_inputs(
    runtime: JournalRuntime, session_id: str, user_id: str | None, *, for_metadata: bool
) -> dict[str, Any]:
    """The inputs the run's record stored, for a resume; ``{}`` for a run with none.

    Raises:
        UserError: ``for_metadata`` (the resume was given no ``metadata=``) and the record is
            damaged: the run's roles are unknown, and a resume decided as a caller with none
            could run what they deny.
        NewerEntryError: ``for_metadata``, and a newer loomflow wrote the record.
    """
    try:
        return await runtime.run_inputs(session_id, user_id)
    except NewerEntryError:
        if for_metadata:
            raise
        return {}
    except CorruptEntryError as exc:
        if for_metadata:
            raise UserError(
                f"the run's record is damaged ({exc}), so this resume cannot reuse the "
                "run's metadata (its roles would be lost): pass metadata= again, as the run "
                "was started"
            ) from None
        return {}  # what the record held beyond the metadata is gone: resumed without it


def stored_metadata(inputs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The metadata a run was started with, from its record's ``inputs``, for a resume given
    none.

    Raises:
        UserError: the record withheld the metadata (it held a secret, or a value the journal
            cannot encode): resumed without it,
            the run would lose its roles and be decided on as a caller with none.
    """
    withheld = inputs.get(RECORD_WITHHELD)
    if isinstance(withheld, list) and "metadata" in withheld:
        raise UserError(
            "the run's metadata held a secret (or a value the journal cannot encode) and was "
            "not journaled, so this resume cannot reuse it (its roles would be lost): pass "
            "metadata= again, as the run was started"
        )
    stored = inputs.get("metadata")
    return stored if isinstance(stored, dict) else None


@contextlib.asynccontextmanager
async def enclosing_run(
    runtime: Runtime,
    session_id: str,
    user_id: str | None,
    metadata: Mapping[str, Any] | None,
    *,
    resume: bool = False,
    strict_replay: bool | None = None,
    record: RunRecord | None = None,
    new_session: bool = False,
) -> AsyncIterator[tuple[RunContext, OpenRun | None]]:
    """Open a run: its RunContext, the shared runtime for agents inside it, and its journal.
    ``new_session`` (a fork's session; a journal only) refuses a session that has runs."""
    ctx = RunContext(
        run_id=str(ULID()),
        session_id=session_id,
        user_id=user_id,
        metadata=MappingProxyType(dict(metadata or {})),
        # A sub-run audits under its own run id: this leads compliance back to the enclosing one.
        parent_run_id=get_run_context().run_id,
    )
    runtime_token = _active_runtime.set(runtime)
    try:
        with use_run_context(ctx):
            opening = (
                runtime.session(
                    session_id,
                    user_id,
                    resume=resume,
                    strict_replay=strict_replay,
                    record=record,
                    new_session=True,
                )
                if new_session and isinstance(runtime, JournalRuntime)
                else runtime.session(
                    session_id, user_id, resume=resume, strict_replay=strict_replay, record=record
                )
            )
            async with opening as run:
                yield ctx, run
    finally:
        reset_var(_active_runtime, runtime_token)


def enclosing_ids() -> tuple[bool, str | None, str | None]:
    """Whether a run is open in this context (an agent's, or a ``runtime.session`` block),
    and its session and user: a run started inside it is a sub-run that works for them."""
    outer = get_run_context()
    if outer.run_id is not None:
        return True, outer.session_id, outer.user_id
    journal_run = run_in_context()
    if journal_run is not None:
        return True, journal_run.session_id, journal_run.user_id
    return False, None, None


def answer_of(name: str, result: RunResult) -> str:
    """What an agent used as a tool answers its caller: its output, or, for a run that was
    interrupted, a :class:`SubAgentInterruptedError` the caller's model reads as the call's
    tool error (an empty answer would pass for finished work)."""
    if result.interrupted:
        raise SubAgentInterruptedError(
            f"the {name} agent was interrupted ({result.interruption_reason}) before it "
            "answered; its task is not done"
        )
    return result.output


def runtime_for(runtime: Runtime | None) -> Runtime:
    """The runtime a run uses: its own, else the enclosing run's (an agent's, or the runtime
    of a ``runtime.session`` block), else no journal."""
    active: Runtime | None = _active_runtime.get()
    if runtime is None and active is None and (journal_run := run_in_context()) is not None:
        active = journal_run.runtime
    return runtime or active or Passthrough()


class Agent:
    """An LLM agent whose runs survive crashes.

    Args:
        instructions: The system prompt.
        model: A :class:`~loomflow.models.Model` or a model string (``"claude-opus-4-7"``,
            ``"gpt-4.1"``, ``"scripted"``), resolved on first use.
        tools: Tools (``@tool`` functions or plain callables) the model may call.
        runtime: The journal. ``None`` journals nothing (unless the agent runs inside another
            run, an agent's or a ``runtime.session`` block, whose runtime it then shares).
        tuning: Loop settings (:class:`Tuning`).
        max_turns: Model calls allowed per run before it stops with ``max_turns``.
        name: A short name used in sub-run keys, spans and tool names. It is also the name
            each run records for recovery: register the agent under it
            (``Recovery(runtime, {agent.name: agent})``). It follows the id rules (non-empty,
            at most 256 UTF-8 bytes, no control characters): ``InvalidIdError`` otherwise.
        memory: Per-user memory (:class:`~loomflow.memory.Memory`): each outermost run is
            reminded of the earlier runs of its (session, user), and records its own turns
            as an episode when it returns. By default (``None``) episodes are kept beside
            the journal (``memory_for(runtime)``), or in this agent's process memory when it
            has no runtime; ``False`` keeps none.
        budget: Spending caps checked before every live model call.
        permissions: The policy checked before every live tool call.
        audit: The per-user audit log.
        guardrails: Checks on input, output and tool results.
        telemetry: Spans and metrics. By default (``None``) every agent of the process shares
            :func:`~loomflow.telemetry.default_telemetry`: spans on the global tracer provider
            (no-ops until the application installs an OpenTelemetry SDK) and metrics on
            prometheus-client's default registry. ``False`` records nothing.
        hooks: Extra :class:`~loomflow.agent.hooks.RunHooks`. Each component above except
            memory (which the loop uses directly) is a ``RunHooks`` too, or provides one
            through ``as_hooks()``; the loop calls them in the order guardrails, budget,
            permissions, audit, telemetry, then ``hooks``. A budget with a ``prices`` table
            prices the run's model calls; an audit log's ``redactor`` seals tool arguments.
        output_type: The default ``output_type`` of :meth:`run`, :meth:`resume` and
            :meth:`stream`: a pydantic model the final answer is validated into
            (``RunResult.parsed``); see ``docs/structured-output.md``.
        output_retries: How many more answers a run asks for after one fails validation
            against its ``output_type`` before raising ``OutputValidationError``.
    """

    def __init__(
        self,
        instructions: str,
        *,
        model: Model | str,
        tools: Sequence[ToolLike] = (),
        runtime: JournalRuntime | None = None,
        memory: Memory | Literal[False] | None = None,
        budget: RunPlugin | None = None,
        permissions: RunPlugin | None = None,
        audit: RunPlugin | None = None,
        guardrails: Sequence[RunPlugin] = (),
        telemetry: RunPlugin | Literal[False] | None = None,
        tuning: Tuning | None = None,
        max_turns: int = 10,
        name: str = "agent",
        hooks: Sequence[RunHooks] = (),
        output_type: type[BaseModel] | None = None,
        output_retries: int = 1,
    ) -> None:
        if not isinstance(instructions, str):
            raise UserError("instructions must be a string")
        check_max_turns(max_turns)
        check_list("tools", tools, "tools")
        check_list("guardrails", guardrails, "guardrails")
        check_list("hooks", hooks, "RunHooks")
        check_runtime(runtime)
        check_tuning(tuning)
        for parameter, component in (
            ("budget", budget),
            ("permissions", permissions),
            ("audit", audit),
            ("telemetry", telemetry),
        ):
            check_plugin(parameter, component)
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
        self._redactor = (
            audit.redactor if isinstance(audit, RedactingAudit) else Redactor.from_settings()
        )
        # loomflow's log records (a failing tool's message and traceback) are scrubbed as its
        # spans are. An audit log decides this itself (AuditLog(redact_logs=...)); without
        # one, nothing did, and a tool's secret reached the logs raw.
        if not isinstance(audit, RedactingAudit):
            install_log_redaction(self._redactor)
        if self._memory_default and self.memory is not None:
            # Facts and blocks written to it lose their secrets as the episodes do.
            self.memory.redactor = self._redactor
        # Sealed tool results of this agent's runs, in this process only (see Sealer).
        self._sealed_results: OrderedDict[str, str] = OrderedDict()
        self._sealed_arguments = SealedArguments()
        self._config_digest: tuple[tuple[Any, ...], object, str] | None = None
        self.guardrails = tuple(guardrails)
        if telemetry is None:
            # Loaded with the first agent, not on import of the agent package.
            from ..telemetry import default_telemetry

            telemetry = default_telemetry()
        self.telemetry: RunPlugin | None = telemetry or None
        self.tuning = tuning or Tuning()
        self.max_turns = max_turns
        # Journaled with every run (recovery finds its agent by it), in audit actors and spans:
        # the id rule, so a NUL or a lone surrogate is refused here, not by a store mid-run.
        check_id("name", name, optional=False)
        self.name = name
        self.hooks = tuple(hooks)
        # Memory is wired into the loop itself (it changes the message stack, which no hook
        # may); a memory that also offers hooks keeps its place in the order.
        memory_hooks = memory if isinstance(memory, HookProvider) else None
        # From the stored tuples: a generator passed as guardrails= or hooks= is spent already.
        # The hooks that check a tool call (guardrails, budget, permissions) lead: a call a
        # later hook rewrites goes through them again (see _Run._live_tool_call).
        self._checks = tuple(hooks_of([*self.guardrails, budget, permissions]))
        later = hooks_of([memory_hooks, audit, self.telemetry, *self.hooks])
        self._hooks = [*self._checks, *later]
        if audit is not None and self.telemetry is not None:
            _count_audit_entries(self.telemetry, audit)
        self._specs = [ToolSpec(**spec) for spec in self.tools.specs()]
        self._settings = ModelSettings(
            max_tokens=self.tuning.max_tokens, temperature=self.tuning.temperature
        )
        self.output_type = None if output_type is None else check_output_type(output_type)
        self.output_retries = check_output_retries(output_retries)
        self._structured(None, None)  # a type with no output format is refused here already

    @classmethod
    def from_settings(
        cls,
        instructions: str,
        *,
        model: Model | str,
        settings: Settings | None = None,
        caps: Sequence[Any] = (),
        prices: Mapping[str, ModelPrice] | None = None,
        **options: Any,
    ) -> Agent:
        """An agent whose journal, audit log, budget and telemetry come from :class:`Settings`.

        The journal is ``runtime_url``; memory, unless given, lives beside it (as for
        :class:`Agent`). The audit log (redacting the configured secrets) is
        ``audit_url`` and the budget's totals ``budget_url``; either, when unset, lives beside
        the journal (in its database, or in memory). The budget enforces ``caps``; with none it
        only records usage (one write after each model call, no reservation; pass ``budget=None``
        to skip it). With ``otlp_endpoint`` (or the standard ``OTEL_EXPORTER_OTLP_*``
        variables) or ``metrics_port`` set, spans are exported and metrics served, once per
        process. Close what this built with :meth:`aclose` or ``async with``.

        Args:
            instructions: The system prompt.
            model: A model or model string, as for :class:`Agent`.
            settings: Defaults to ``Settings()`` (``LOOMFLOW_*`` variables and ``.env``).
            caps: :class:`~loomflow.governance.Cap` objects for the budget.
            prices: Extra or overriding model prices for the budget, as
                ``StandardBudget(prices=...)`` takes them (``{"my-model": ModelPrice(3.0,
                15.0)}``): the budget charges, and ``RunResult.cost_usd``, the audit trail and
                the metrics report, calls at these prices.
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
        from ..telemetry import Telemetry, setup_requested, setup_telemetry_once

        s = settings or Settings()
        if caps and "budget" in options:
            raise UserError("pass either caps= or budget=, not both")
        if prices is not None and "budget" in options:
            # A given budget prices the run with its own table: this one would be ignored.
            raise UserError(
                "pass either prices= or budget=, not both (give the budget the prices: "
                "StandardBudget(prices=...))"
            )
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
            options["budget"] = StandardBudget(caps, store=stores.budget, prices=prices)
            owned.append(options["budget"])
        if "telemetry" not in options:
            if setup_requested(s):  # LOOMFLOW_* settings or the standard OTEL_* variables
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
            "telemetry": self.telemetry if self.telemetry is not None else False,
            "tuning": self.tuning,
            "max_turns": self.max_turns,
            "name": self.name,
            "hooks": self.hooks,
            "output_type": self.output_type,
            "output_retries": self.output_retries,
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
        # A model given by name is built on first use; printing the agent (a log line, a
        # debugger) must not build it, which fails without the provider's credentials.
        spec = self._model_spec
        model = spec if isinstance(spec, str) else self.model.name
        return f"Agent(name={self.name!r}, model={model!r}, tools={list(self.tools)})"

    def config_fingerprint(self) -> str:
        """A digest of what shapes this agent's steps: instructions, model, tools, limits.

        Stored with each run; a recoverer refuses to resume a run with an agent whose
        fingerprint differs (its journaled steps would diverge from what the agent now does).
        """
        model = self._model_spec if isinstance(self._model_spec, str) else self.model.name
        # Every run stores it: kept while what it digests is unchanged (the tool specs are
        # frozen values built once per agent, so their identity stands for them).
        key = (self.instructions, model, self.max_turns)
        kept = self._config_digest
        if kept is not None and kept[0] == key and kept[1] is self._specs:
            return kept[2]
        shape = {
            "instructions": self.instructions,
            "model": model,
            "tools": [spec.model_dump(mode="json") for spec in self._specs],
            "max_turns": self.max_turns,
        }
        digest = json.dumps(shape, sort_keys=True, default=str, ensure_ascii=False)
        value = hashlib.sha256(digest.encode("utf-8", "surrogatepass")).hexdigest()
        self._config_digest = (key, self._specs, value)
        return value

    def _record(
        self,
        prompt: str,
        metadata: Mapping[str, Any] | None,
        structured: StructuredOutput | None = None,
        fork: Checkpoint | None = None,
    ) -> RunRecord:
        return run_record(
            self.name, self.config_fingerprint(), self._redactor, prompt, metadata, structured, fork
        )

    def default_output_contract(self) -> dict[str, Any] | None:
        """What a run of this agent with its default ``output_type`` records (or ``None``)."""
        structured = self._structured(None, None)
        return None if structured is None else output_contract(structured)

    @property
    def redactor(self) -> Redactor:
        """What keeps secrets out of this agent's journal, audit entries and spans."""
        return self._redactor

    @property
    def model(self) -> Model:
        """The model, resolved from its string on first use."""
        if self._model is None:
            self._model = resolve_model(self._model_spec)
        return self._model

    # -- public API ------------------------------------------------------------------------

    @overload
    async def run(
        self,
        prompt: str,
        *,
        session_id: str | None = None,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        output_type: None = None,
        output_retries: int | None = None,
    ) -> RunResult: ...

    @overload
    async def run(
        self,
        prompt: str,
        *,
        session_id: str | None = None,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        output_type: type[OutputModel],
        output_retries: int | None = None,
    ) -> RunResult[OutputModel]: ...

    async def run(
        self,
        prompt: str,
        *,
        session_id: str | None = None,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        output_type: type[BaseModel] | None = None,
        output_retries: int | None = None,
    ) -> RunResult[Any]:
        """Run the agent on ``prompt`` until it answers (or is interrupted).

        With ``output_type`` (default: the agent's), the final answer is validated into that
        pydantic model and returned as ``RunResult.parsed``; an answer that does not fit is
        sent back with the errors, up to ``output_retries`` times (default: the agent's),
        then :class:`~loomflow.errors.OutputValidationError` is raised.
        """
        options = {"output_type": output_type, "output_retries": output_retries}
        return await self._drained(prompt, session_id, user_id, metadata, resume=False, **options)

    @overload
    async def resume(
        self,
        prompt: str,
        *,
        session_id: str,
        user_id: str | None = None,
        from_checkpoint: str | None = None,
        fork_session_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        output_type: None = None,
        output_retries: int | None = None,
        approvals: Mapping[str, DecisionLike] | None = None,
        decided_by: str | None = None,
    ) -> RunResult: ...

    @overload
    async def resume(
        self,
        prompt: str,
        *,
        session_id: str,
        user_id: str | None = None,
        from_checkpoint: str | None = None,
        fork_session_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        output_type: type[OutputModel],
        output_retries: int | None = None,
        approvals: Mapping[str, DecisionLike] | None = None,
        decided_by: str | None = None,
    ) -> RunResult[OutputModel]: ...

    async def resume(
        self,
        prompt: str,
        *,
        session_id: str,
        user_id: str | None = None,
        from_checkpoint: str | None = None,
        fork_session_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        output_type: type[BaseModel] | None = None,
        output_retries: int | None = None,
        approvals: Mapping[str, DecisionLike] | None = None,
        decided_by: str | None = None,
    ) -> RunResult[Any]:
        """Continue the session's last run, finished or not.

        With ``Tuning(checkpoint=True)`` and a snapshot of that run, the snapshot is restored
        directly: no replay walk, no memory recall, prior turns neither re-run nor re-billed
        (their usage is carried into the result). Otherwise the run is replayed from the
        journal. Pass the prompt and user of the original run: the journal matches steps by
        their inputs, and a snapshot taken for another prompt is refused.

        ``from_checkpoint=<id>`` (an id from :meth:`list_checkpoints`) forks that snapshot into
        a new session (``fork_session_id``, or a fresh ULID; see ``RunResult.session_id``) and
        continues there; the original session is left untouched. ``metadata`` is the run
        context's metadata, as for :meth:`run`; left out, the resume gets the metadata the
        run was started with (its run record's), so its roles are the first attempt's; metadata
        that held a secret (or a value the journal cannot encode) was not kept, and must be
        passed again.

        Pass the ``output_type`` of the original run (it keys its model calls); the parsed
        answer is rebuilt by validating the journaled text again.

        ``approvals={request_id: decision}`` decides tool calls a run stopped at
        (``StandardPermissions(approval="defer")``, see :meth:`pending_approvals`): each
        decision is ``Approve()``, ``Approve(arguments={...})`` (run with edited arguments),
        ``Deny(reason)``, or ``"allow"``/``"deny"``. The decisions are journaled (and audited
        as made by ``decided_by``) before the run continues: an allowed call then runs once, a
        denied one reaches the model as a denial. Calls left undecided stop the run again,
        with the same request ids.

        Raises:
            CheckpointNotFoundError: ``from_checkpoint`` is not a snapshot of this
                (session, user).
            UserError: the snapshot was taken for another prompt, or checkpoints are off, or
                the run's metadata held a secret and ``metadata=`` is left out.
            ApprovalNotFoundError: an approval names no request of the session's last run.
            ApprovalDecidedError: an approval names a request decided before.
            ApprovalArgumentsError: edited arguments do not fit the tool's schema.
        """
        if approvals and from_checkpoint is not None:
            raise UserError(
                "approvals= continue the stopped run of the session; a fork (from_checkpoint=) "
                "starts a new session that holds no approval requests"
            )
        if approvals:
            check_id("session_id", session_id)
            check_id("user_id", user_id)
            # What the resume itself would refuse is refused before any decision is audited
            # and journaled: a decision is final, so the corrected call would otherwise meet
            # ApprovalDecidedError for the very decisions it carries.
            if not isinstance(prompt, str):
                raise UserError("prompt must be a string")
            self._structured(output_type, output_retries)
            check_metadata(metadata)
            if fork_session_id is not None:
                raise UserError("fork_session_id= goes with from_checkpoint=")
            runtime = self._runtime()
            if metadata is None and isinstance(runtime, JournalRuntime) and not enclosing_ids()[0]:
                # As the resume reads it below (a sub-run takes the enclosing run's instead).
                stored_metadata(
                    await stored_inputs(runtime, session_id, user_id, for_metadata=True)
                )
            await decide(self, session_id, user_id, approvals, decided_by, valid_line(prompt))
        return await self._drained(
            prompt,
            session_id,
            user_id,
            metadata,
            resume=True,
            from_checkpoint=from_checkpoint,
            fork_session_id=fork_session_id,
            output_type=output_type,
            output_retries=output_retries,
        )

    async def pending_approvals(
        self, session_id: str, *, user_id: str | None = None
    ) -> list[PendingApproval]:
        """The tool calls of the session's last run that wait for a decision, read from the
        journal (so any process on the same database sees them); decide them with
        :meth:`resume`. A new :meth:`run` on the session leaves them behind."""
        check_id("session_id", session_id)
        check_id("user_id", user_id)
        return await pending_of(self, session_id, user_id)

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
        output_type: type[BaseModel] | None = None,
        output_retries: int | None = None,
    ) -> AsyncIterator[AgentEvent]:
        """Run the agent and yield its events; the last one is :class:`RunFinished`.

        ``output_type`` and ``output_retries`` work as for :meth:`run`: the final event's
        ``result.parsed`` holds the validated answer.
        """
        return self._events(
            prompt,
            session_id,
            user_id,
            metadata,
            resume=False,
            output_type=output_type,
            output_retries=output_retries,
        )

    def as_tool(self, name: str | None = None, description: str | None = None) -> Tool[..., Any]:
        """This agent as a tool for another agent; its steps journal under the caller's run."""

        async def delegate(task: str) -> str:
            ctx = get_run_context()
            result = await self.run(
                task, session_id=ctx.session_id, user_id=ctx.user_id, metadata=ctx.metadata
            )
            return answer_of(self.name, result)

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

    async def _drained(
        self,
        prompt: str,
        session_id: str | None,
        user_id: str | None,
        metadata: Mapping[str, Any] | None,
        **options: Any,
    ) -> RunResult:
        """The run's result, its events drained in a copy of the caller's context as a whole
        (as :meth:`_events` copies it for a stream), not event by event: the same isolation,
        handed over once per run instead of once per event."""
        events = vars(self).get("_events")
        if events is not None:
            # A Team's lead: the team tracks its runs through _events (the workers' memory
            # for a resume through the lead), so those go that way, as a stream's do.
            return await self._drain(events(prompt, session_id, user_id, metadata, **options))
        return await in_own_context(
            self._drain(self._run_events(prompt, session_id, user_id, metadata, **options))
        )

    def _runtime(self) -> Runtime:
        return runtime_for(self.runtime)

    async def _run_events(
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
        output_type: type[BaseModel] | None = None,
        output_retries: int | None = None,
    ) -> AsyncGenerator[AgentEvent, None]:
        if not isinstance(prompt, str):
            raise UserError("prompt must be a string")
        # A lone surrogate (no character: no text column or audit hash can hold one) or a NUL
        # (no PostgreSQL text can) becomes U+FFFD, the same way on the first run and on a resume.
        prompt = valid_line(prompt)
        structured = self._structured(output_type, output_retries)
        # Refused before anything runs: an empty session id must not become a fresh session
        # (a redelivered request would repeat its side effects), nor a too-long id a driver
        # error halfway through the run.
        check_id("session_id", session_id)
        check_id("user_id", user_id)
        check_id("from_checkpoint", from_checkpoint)
        check_id("fork_session_id", fork_session_id)
        check_metadata(metadata)
        # Built before the run is opened: a missing SDK or API key would otherwise leave an
        # open run without a step in the journal.
        self.model  # noqa: B018
        runtime = self._runtime()
        # Inside another run (an agent's, or a runtime.session block) this one is a sub-run
        # of it and inherits who it works for: a session id made up here would name its
        # sub-run differently on every attempt, and a resume would replay none of it.
        nested, outer_session, outer_user = enclosing_ids()
        if resume and not nested and isinstance(runtime, Passthrough):
            # As a journal's resume that finds no run says: every tool call runs again.
            log.warning(
                "agent %r has no runtime, so resume() has no journal to continue: session %r "
                "runs afresh and its tools run again (give the agent a runtime=)",
                self.name,
                session_id,
            )
        if nested:
            session_id = session_id if session_id is not None else outer_session
            user_id = user_id if user_id is not None else outer_user
            if metadata is None:
                # And for the same caller: the enclosing run's roles decide its sub-runs'
                # tool calls too (an agent run from a tool would otherwise have none).
                metadata = get_run_context().metadata
        continuing = resume and from_checkpoint is None and not nested
        inputs: dict[str, Any] = {}
        if continuing and isinstance(runtime, JournalRuntime) and session_id:
            inputs = await stored_inputs(
                runtime, session_id, user_id, for_metadata=metadata is None
            )
            if metadata is None:
                # The run's own metadata (its roles, say), as a recoverer resumes it: without
                # it the resumed run would be decided on as some other caller's.
                metadata = stored_metadata(inputs)
        store = self._checkpoint_store(runtime) if self.tuning.checkpoint and not nested else None
        source: Checkpoint | None = None
        if continuing and session_id and inputs.get(RECORD_FORK) is not None:
            # A fork's run that a crash stopped before its first snapshot: seeded again from
            # the snapshot it forks, as the fork was (its session holds nothing else).
            source = await _fork_reseed(
                store, inputs[RECORD_FORK], session_id, user_id, prompt, structured
            )
        claiming: asyncio.Lock | None = None  # held from the fork session's check to its claim
        if from_checkpoint is not None:
            source = await _fork_source(
                store, from_checkpoint, session_id, user_id, prompt, structured
            )
            if fork_session_id == session_id:
                raise UserError("a fork needs a session id of its own")
            # Forking into a session that has runs would continue its last run (an open one
            # would be taken over and never resumed) or add to its history. Two forks into
            # one new session id in this process take turns from this check to the claim of
            # the session, so the second sees the first's run and is refused.
            if fork_session_id is not None and isinstance(runtime, JournalRuntime):
                claiming = _fork_lock(runtime, fork_session_id, user_id)
                await claiming.acquire()
                try:
                    taken = await runtime.sessions(
                        session_id=fork_session_id, user_id=user_id, limit=1
                    )
                except BaseException:
                    claiming.release()
                    raise
                if taken:
                    claiming.release()
                    raise SessionExistsError(
                        f"fork_session_id {fork_session_id!r} names a session that already "
                        "has runs: a fork needs a new session (leave fork_session_id out for a "
                        "fresh id)"
                    )
            session_id, resume = fork_session_id or str(ULID()), False
        elif fork_session_id is not None:
            raise UserError("fork_session_id= goes with from_checkpoint=")
        if session_id is None:
            session_id = str(ULID())
        end_untraced: Callable[[], None] | None = None
        try:
            async with enclosing_run(
                runtime,
                session_id,
                user_id,
                metadata,
                resume=resume,
                strict_replay=self.tuning.strict_replay,
                # Only a journal keeps a record (recovery reads it); building one costs a
                # fingerprint of the configuration and a secret scan of the prompt.
                record=(
                    self._record(prompt, metadata, structured, source)
                    if not nested and isinstance(runtime, JournalRuntime)
                    else None
                ),
                # A fork's session, also across processes: checked and claimed in one write.
                new_session=source is not None and fork_session_id is not None,
            ) as (ctx, open_run):
                if claiming is not None:  # the fork session is ours now: let others look
                    claiming.release()
                    claiming = None
                if self.telemetry is None and ctx.run_id is not None:
                    # telemetry=False: no spans for its steps either, also on a runtime that
                    # another agent's telemetry instrumented.
                    from ..telemetry._hooks import untraced_run

                    end_untraced = untraced_run(ctx.run_id)
                restore = source
                if restore is None and resume and store is not None:
                    restore = await latest_of_run(store, ctx, open_run, prompt, structured)
                yield RunStarted(run_id=ctx.run_id or "", session_id=session_id, user_id=user_id)
                run = _Run(
                    self,
                    runtime,
                    ctx,
                    open_run,
                    prompt,
                    history,
                    store=store,
                    restore=restore,
                    forked=source is not None,
                    memory=None if nested else self.memory,
                    structured=structured,
                )
                # aclosing: a closed stream ends its run here, before the run's session does.
                async with contextlib.aclosing(run.events()) as events:
                    async for event in events:
                        if (
                            isinstance(event, RunFinished)
                            and not nested
                            and isinstance(open_run, JournalRun)
                            and event.result.interrupted
                        ):
                            open_run.outcome = "interrupted"  # stored as the run's final status
                        # Hooks' own events (budget warnings, permission decisions, ...) travel
                        # the stream too; AgentEvent names only the agent's.
                        yield cast(AgentEvent, event)
        except StoreUnavailableError as exc:
            # A journal that cannot open the run fails it before any hook hears of it.
            _count_store_failure(self.telemetry, exc)
            raise
        finally:
            if claiming is not None:
                claiming.release()
            if end_untraced is not None:
                end_untraced()

    # A copy of the reader's context: an abandoned stream must not leave its run's context
    # variables in the reader's context (see own_context).
    _events = own_context(_run_events)

    def _structured(
        self, output_type: type[BaseModel] | None, output_retries: int | None
    ) -> StructuredOutput | None:
        """The run's output contract: the given type and retries, else the agent's."""
        chosen = output_type if output_type is not None else self.output_type
        retries = output_retries if output_retries is not None else self.output_retries
        if chosen is None:
            if output_retries is not None:
                check_output_retries(output_retries)
            return None
        return StructuredOutput(chosen, retries, tool_names=list(self.tools))

    def _checkpoint_store(self, runtime: Runtime) -> CheckpointStore:
        if not isinstance(runtime, JournalRuntime):
            raise UserError(
                "Tuning(checkpoint=True) needs a journaled runtime (InMemoryRuntime, "
                "SqliteRuntime or PostgresRuntime): checkpoints are stored beside the journal"
            )
        return checkpoint_store_for(runtime)


def _metrics_of(telemetry: RunPlugin | None) -> Metrics | None:
    from ..telemetry import Metrics, Telemetry

    if isinstance(telemetry, Telemetry):
        return telemetry.metrics
    return telemetry if isinstance(telemetry, Metrics) else None


def _count_audit_entries(telemetry: RunPlugin, audit: RunPlugin) -> None:
    """Let the agent's metrics count what its audit log appends (the two layers do not know
    each other; the agent, which holds both, connects them)."""
    metrics = _metrics_of(telemetry)
    if metrics is not None:
        metrics.count_audit(audit)


def _count_store_failure(telemetry: RunPlugin | None, exc: StoreUnavailableError) -> None:
    """Count a store failure in the agent's metrics (once: a run that began counted it)."""
    metrics = _metrics_of(telemetry)
    if metrics is not None:
        metrics.store_failed(exc)


# Per journal object, the (fork session, user) pairs a fork is about to claim; entries go
# with their runtime.
_fork_locks: weakref.WeakKeyDictionary[
    JournalRuntime, dict[tuple[str, str | None], asyncio.Lock]
] = weakref.WeakKeyDictionary()


def _fork_lock(runtime: JournalRuntime, session_id: str, user_id: str | None) -> asyncio.Lock:
    locks = _fork_locks.setdefault(runtime, {})
    return locks.setdefault((session_id, user_id), _ForkLock(locks, (session_id, user_id)))


class _ForkLock(asyncio.Lock):
    """A fork session's lock, dropped from its runtime's table once nobody holds or awaits it
    (fork session ids are new each time: the table must not grow with them)."""

    def __init__(
        self, table: dict[tuple[str, str | None], asyncio.Lock], key: tuple[str, str | None]
    ) -> None:
        super().__init__()
        self._table, self._key = table, key

    def release(self) -> None:
        super().release()
        drop_if_idle(self._table, self._key, self)


async def _fork_source(
    store: CheckpointStore | None,
    checkpoint_id: str,
    session_id: str | None,
    user_id: str | None,
    prompt: str,
    structured: StructuredOutput | None,
) -> Checkpoint:
    """The snapshot ``resume(from_checkpoint=...)`` forks: of (session, user), for ``prompt``
    and the run's output contract (a fork has no journal of its own to fall back to)."""
    if store is None:
        raise UserError("from_checkpoint= needs an agent with Tuning(checkpoint=True)")
    source = await store.get(checkpoint_id, session_id=session_id or "", user_id=user_id)
    if source is None:
        raise CheckpointNotFoundError(
            f"no checkpoint {checkpoint_id!r} in session {session_id!r} of {user_label(user_id)}"
        )
    check_prompt(source, prompt)
    if (why := contract_mismatch(source, structured)) is not None:
        raise UserError(
            f"checkpoint {checkpoint_id!r} of session {session_id!r} {why}: fork it with the "
            "output_type it was taken with, or use run() for a new request"
        )
    if (why := inconsistency(source)) is not None:
        raise CheckpointError(f"checkpoint {checkpoint_id!r} cannot be forked: it {why}")
    return source


async def _fork_reseed(
    store: CheckpointStore | None,
    fork: Any,
    session_id: str,
    user_id: str | None,
    prompt: str,
    structured: StructuredOutput | None,
) -> Checkpoint | None:
    """What a resume of a fork's run (``fork``: what its record names) continues when the fork's
    session has no snapshot: the checkpoint it was forked from; ``None`` when the session has
    one (the fork's own snapshots then say where it stands).

    Raises:
        UserError: the agent takes no snapshots, so it cannot continue a fork.
        CheckpointNotFoundError: the checkpoint forked from is gone.
    """
    if not isinstance(fork, dict) or not all(
        isinstance(fork.get(key), str) for key in ("session_id", "checkpoint")
    ):
        raise CorruptEntryError(
            f"the record of session {session_id!r} names the checkpoint it was forked from in "
            "a form that cannot be read"
        )
    source_session, checkpoint_id = fork["session_id"], fork["checkpoint"]
    if store is None:
        # Journal replay alone would start the fork over from the prompt, in a transcript
        # without the forked turns.
        raise UserError(
            f"session {session_id!r} is a fork of checkpoint {checkpoint_id!r}: resume it with "
            "an agent built with Tuning(checkpoint=True)"
        )
    try:
        if await store.latest(session_id, user_id=user_id) is not None:
            return None
    except CheckpointError:
        return None  # a snapshot is there, if damaged: the resume reports it as for any run
    try:
        return await _fork_source(store, checkpoint_id, source_session, user_id, prompt, structured)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"session {session_id!r} is a fork that stopped before its first snapshot, and "
            f"checkpoint {checkpoint_id!r} of session {source_session!r} it was forked from is "
            "gone: resuming it would start the task again from its prompt (cancel the run, or "
            "fork again from a checkpoint that is kept)"
        ) from exc


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
