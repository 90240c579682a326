"""The audit log component: what the agent loop writes, through the hook seam.

``Agent(audit=AuditLog(store))`` plugs :class:`AuditHooks` into the loop. Every entry is
redacted before it is handed to the store; the store seals it into the user's chain.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

from pydantic import BaseModel
from ulid import ULID

from .._cleanup import end_outcome
from .._ids import check_id
from .._progress import OnProgress
from ..context import get_run_context
from ..errors import InvalidArgumentError, UserError
from ..governance.events import (
    ApprovalRequested,
    BudgetDenied,
    BudgetUnavailable,
    BudgetWarning,
    GovernanceEvent,
    GuardrailTripped,
    PermissionDecided,
)
from ..hooks import RunHooks, RunInfo
from ..messages import Message, ModelResponse, ModelSettings, ToolCall
from ..redaction import Redactor, install_log_redaction
from ..runtime import StepEvent
from ..tools import Tool, ToolOutcome
from . import actions
from ._entry import AuditEntry, AuditRecord, too_deep
from ._store import ANY_USER, AuditPage, AuditStore, ChainHead, ChainProblem, VerifyReport
from ._url import audit_store_from_url

__all__ = ["AuditHooks", "AuditLog"]

log = logging.getLogger("loomflow.audit")


class AuditLog:
    """The per-user audit trail of agent runs, for compliance teams.

    Args:
        store: An :class:`~loomflow.audit.AuditStore`, a store URL, or ``None`` for
            ``LOOMFLOW_AUDIT_URL``, else the journal's ``LOOMFLOW_RUNTIME_URL``.
        redactor: What to scrub before storage; by default built from ``Settings``
            (secret shapes, ``redact_secrets``, ``redact_env``).
        on_error: ``"raise"`` (default) makes a failed audit write fail the run, which stays
            open and resumable: no action goes unrecorded. ``"log"`` logs and carries on.
        max_text: Longest string kept in a payload (prompts, results); longer ones are cut.
        redact_logs: Also scrub loomflow's own log records with this redactor.

    Example:
        >>> audit = AuditLog("sqlite:///audit.db")
        >>> agent = Agent("...", model="claude-opus-4-7", audit=audit)
        >>> page = await audit.query(user_id="alice", action="tool.*")
    """

    def __init__(
        self,
        store: AuditStore | str | None = None,
        *,
        redactor: Redactor | None = None,
        on_error: Literal["raise", "log"] = "raise",
        max_text: int | None = 2000,
        redact_logs: bool = True,
    ) -> None:
        if on_error not in ("raise", "log"):
            raise InvalidArgumentError(f"on_error must be 'raise' or 'log', not {on_error!r}")
        if store is None or isinstance(store, str):
            from ..config import Settings

            store = audit_store_from_url(store if store is not None else Settings().audit_store_url)
        self.store: AuditStore = store
        self.redactor = redactor if redactor is not None else Redactor.from_settings()
        self.on_error = on_error
        self.max_text = max_text
        if redact_logs:
            install_log_redaction(self.redactor)
        self._observers: list[Callable[[AuditEntry], None]] = []
        self._hooks = AuditHooks(self)

    def __repr__(self) -> str:
        return f"AuditLog({self.store!r})"

    def as_hooks(self) -> AuditHooks:
        """The loop hooks that write this log (``Agent(audit=...)`` calls it)."""
        return self._hooks

    def add_observer(self, observer: Callable[[AuditEntry], None]) -> None:
        """Call ``observer`` with every entry this log appends (its runs' and ``record``'s),
        after the store took it; telemetry counts entries this way. An observer that fails
        is logged, never propagated."""
        self._observers.append(observer)

    async def _append(self, records: Sequence[AuditRecord]) -> list[AuditEntry]:
        # The store's trusted path: the loop's own actions, and record()'s checked above.
        entries = await self.store._write(records)
        for entry in entries:
            for observer in self._observers:
                try:
                    observer(entry)
                except Exception:
                    log.exception("audit observer %r failed", observer)
        return entries

    async def record(
        self,
        action: str,
        *,
        user_id: str | None,
        actor: str,
        payload: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        run_id: str | None = None,
    ) -> AuditEntry:
        """Append an entry of your own (a human approval given elsewhere, an export, ...).

        The payload is redacted like the loop's own entries.

        Raises:
            InvalidIdError: an id is not a string, is empty or too long, or holds a control
                character.
            InvalidArgumentError: the payload is nested too deep to store (more than
                ``MAX_PAYLOAD_DEPTH``, 200, lists and objects deep), or contains itself.
            ReservedActionError: ``action`` is one loomflow keeps for itself (``audit.*``,
                ``legal_hold.*``, ``console.*``: erasures, holds and the console's record of
                looks, which verification and erasure rely on), or ``user_id`` names a
                console chain (``console:<name>``). So is an action that reads like a
                reserved one (``legaI_hold.placed``, ``AUDIT.erasure``, ``audit\u2024erasure``:
                see :func:`loomflow.audit.actions.reserved_lookalike`).
        """
        check_id("user_id", user_id)
        check_id("session_id", session_id)
        check_id("run_id", run_id)
        actions.refuse_reserved(action, user_id)
        try:
            redacted = self.redactor.value(dict(payload or {}), max_text=self.max_text)
        except RecursionError:
            raise too_deep(action) from None
        entries = await self._append(
            [
                AuditRecord(
                    user_id=user_id,
                    session_id=session_id,
                    run_id=run_id,
                    actor=actor,
                    action=action,
                    payload=redacted,
                )
            ]
        )
        return entries[0]

    async def query(
        self,
        *,
        user_id: str | None = ANY_USER,
        session_id: str | None = None,
        run_id: str | None = None,
        action: str | None = None,
        since: dt.datetime | float | None = None,
        until: dt.datetime | float | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> AuditPage:
        """One page of entries; see :meth:`AuditStore.query`."""
        return await self.store.query(
            user_id=user_id,
            session_id=session_id,
            run_id=run_id,
            action=action,
            since=since,
            until=until,
            limit=limit,
            cursor=cursor,
        )

    async def count(self, **filters: Any) -> int:
        """How many entries the filters of :meth:`query` select; see :meth:`AuditStore.count`."""
        return await self.store.count(**filters)

    async def export(
        self,
        dest: str | os.PathLike[str] | TextIO,
        *,
        on_progress: OnProgress | None = None,
        on_damaged: Callable[[ChainProblem], None] | None = None,
        **filters: Any,
    ) -> int:
        """Write matching entries as JSON lines; see :meth:`AuditStore.export`."""
        return await self.store.export(
            dest, on_progress=on_progress, on_damaged=on_damaged, **filters
        )

    async def verify(
        self,
        *,
        user_id: str | None = ANY_USER,
        on_progress: OnProgress | None = None,
        heads: Iterable[ChainHead] = (),
    ) -> VerifyReport:
        """Check the hash chains (and heads saved earlier); see :meth:`AuditStore.verify`."""
        return await self.store.verify(user_id=user_id, on_progress=on_progress, heads=heads)

    async def close(self) -> None:
        """Close the store."""
        await self.store.close()


@dataclass(slots=True)
class _RunState:
    info: RunInfo
    pending: list[AuditRecord] = field(default_factory=list)
    executions: dict[str, str] = field(default_factory=dict)  # tool step -> execution id
    sensitive: dict[str, frozenset[str]] = field(default_factory=dict)


class AuditHooks(RunHooks):
    """Writes run, model, tool, governance and replay entries (see ``loomflow.audit.actions``).

    Live work is written in two halves so that a crash cannot hide it: ``model.start`` before
    the request is sent and ``model.call`` (or ``model.error``) after; ``tool.call`` before the
    tool body runs and ``tool.result`` once it returned, before its journal entry is written.
    Both halves carry the same ``execution`` id. A replayed model or tool call is written as
    ``model.replay`` / ``tool.replay``. Replay
    divergences come from the runtime's step observer, which this hook registers on the run's
    runtime the first time it sees it and which reports to the run in whose context the
    diverging step ran.
    """

    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit
        self._runs: dict[str, _RunState] = {}
        self._observed: weakref.WeakSet[Any] = weakref.WeakSet()

    # -- plumbing ---------------------------------------------------------------------------

    def _record(
        self, info: RunInfo, action: str, payload: dict[str, Any], actor: str | None = None
    ) -> AuditRecord:
        return AuditRecord(
            user_id=info.user_id,
            session_id=info.ctx.session_id,
            run_id=info.ctx.run_id,
            actor=actor or f"agent:{info.agent_name}",
            action=action,
            payload=self.audit.redactor.value(payload, max_text=self.audit.max_text),
        )

    async def _write(self, info: RunInfo, *records: AuditRecord) -> None:
        state = self._runs.get(info.run_id)
        batch = [*(state.pending if state else ()), *records]
        if state is not None:
            state.pending = []
        if not batch:
            return
        try:
            await self.audit._append(batch)
        except Exception:
            if self.audit.on_error == "raise":
                raise
            log.exception("audit write of %d entries failed; the run goes on", len(batch))

    def _sensitive(self, info: RunInfo, name: str) -> frozenset[str] | None:
        """The tool's declared sensitive argument names, or ``None`` if it is unknown."""
        tools = getattr(info, "tools", None)  # RunInfo.tools, where the agent provides it
        found = tools.get(name) if tools is not None else None
        if isinstance(found, Tool):
            return found.sensitive
        state = self._runs.get(info.run_id)
        return state.sensitive.get(name) if state is not None else None

    def _arguments(self, info: RunInfo, call: ToolCall) -> dict[str, Any]:
        sensitive = self._sensitive(info, call.name)
        if sensitive:
            self.audit.redactor.learn([call.arguments.get(n) for n in sensitive])
        return self.audit.redactor.arguments(
            call.arguments, sensitive, max_text=self.audit.max_text
        )

    def _observe_runtime(self, info: RunInfo) -> None:
        runtime = info.runtime
        add = getattr(runtime, "add_observer", None)
        if add is None or runtime in self._observed:
            return
        self._observed.add(runtime)
        observed = weakref.ref(self)

        def observer(event: StepEvent) -> None:
            hooks = observed()
            if hooks is not None:
                hooks._on_step(event)

        add(observer)

    def _on_step(self, event: StepEvent) -> None:
        if event.outcome != "divergence":
            return
        state = self._runs.get(get_run_context().run_id or "")
        if state is None:  # a step of a sub-run without this audit: the enclosing run's
            candidates = [
                s
                for s in self._runs.values()
                if s.info.ctx.session_id == event.session_id and s.info.user_id == event.user_id
            ]
            if not candidates:
                return
            state = candidates[-1]
        state.pending.append(
            self._record(
                state.info,
                actions.REPLAY_DIVERGENCE,
                {
                    "step": event.name,
                    "kind": event.kind,
                    "path": list(event.path),
                    "epoch": event.epoch,
                    "backend": event.backend,
                },
                actor="runtime",
            )
        )

    # -- hook points ------------------------------------------------------------------------

    async def run_started(self, info: RunInfo) -> None:
        if _console_chain(info.user_id):
            # Its entries would join the console's record of looks, which erasure keeps.
            raise UserError(
                f"user id {str(info.user_id)[:80]!r} names a console chain (console:<name>), which "
                "only the console writes: an audited run needs another user id"
            )
        self._runs[info.run_id] = _RunState(info)
        self._observe_runtime(info)
        await self._write(
            info,
            self._record(
                info,
                actions.RUN_START,
                {
                    "agent": info.agent_name,
                    "model": info.model_name,
                    "provider": info.provider,
                    "backend": info.backend,
                    "epoch": info.epoch,
                    "resumed": info.resumed,
                    "prompt": info.prompt,
                    "metadata": dict(info.ctx.metadata),
                    # Only a sub-run's: the run it was started inside.
                    **({"parent_run_id": parent} if (parent := info.ctx.parent_run_id) else {}),
                },
            ),
        )

    async def before_model_call(
        self, info: RunInfo, turn: int, messages: list[Message], settings: ModelSettings
    ) -> Any:
        execution = str(ULID())
        await self._write(
            info,
            self._record(
                info,
                actions.MODEL_START,
                {
                    "turn": turn,
                    "step": f"model_call_{turn}",
                    "model": info.model_name,
                    "provider": info.provider,
                    "execution": execution,
                },
            ),
        )
        return execution  # handed back to after_model_call / model_call_failed

    async def model_call_failed(
        self, info: RunInfo, turn: int, error: BaseException, token: Any
    ) -> None:
        record = self._record(
            info,
            actions.MODEL_ERROR,
            {
                "turn": turn,
                "step": f"model_call_{turn}",
                "execution": token,
                "error_type": type(error).__name__,
                "error": str(error),
            },
        )
        try:
            await self._write(info, record)
        except Exception:
            # The run is failing already, with the error that matters; the trail keeps the
            # model.start without an outcome, which says exactly that much.
            log.exception("audit write of a failed model call failed")

    async def model_call_finished(
        self, info: RunInfo, turn: int, response: ModelResponse, *, token: Any
    ) -> None:
        # Written before the response is journaled: if the journal write fails, the resumed
        # run calls the model again and the trail shows both (billed) calls.
        await self._model_call(info, turn, response, replayed=False, execution=token)

    async def after_model_call(
        self, info: RunInfo, turn: int, response: ModelResponse, *, replayed: bool, token: Any
    ) -> None:
        if replayed:  # a live call was written by model_call_finished
            await self._model_call(info, turn, response, replayed=True, execution=None)

    async def _model_call(
        self,
        info: RunInfo,
        turn: int,
        response: ModelResponse,
        *,
        replayed: bool,
        execution: str | None,
    ) -> None:
        model = response.model or info.model_name
        cost = info.cost_usd(response)  # as the run and its budget price it
        payload = {
            "turn": turn,
            "step": f"model_call_{turn}",
            "model": model,
            "provider": info.provider,
            "input_tokens": response.usage.input_tokens,
            "output_tokens": response.usage.output_tokens,
            "cost_usd": cost,
            "finish_reason": response.finish_reason,
            "tool_calls": [c.name for c in response.tool_calls],
            "replayed": replayed,
        }
        # The prompt-cache parts of input_tokens, only when there are any (entries without a
        # cache stay as they were).
        if response.usage.cache_read_tokens:
            payload["cache_read_tokens"] = response.usage.cache_read_tokens
        if response.usage.cache_write_tokens:
            payload["cache_write_tokens"] = response.usage.cache_write_tokens
        if replayed:
            payload["billed"] = False  # a replay costs nothing: the journal answered
        else:
            payload["execution"] = execution
        # Learn the sensitive argument values now, before any tool or log line can show them.
        for call in response.tool_calls:
            sensitive = self._sensitive(info, call.name)
            if sensitive:
                self.audit.redactor.learn([call.arguments.get(n) for n in sensitive])
        await self._write(
            info,
            self._record(info, actions.MODEL_REPLAY if replayed else actions.MODEL_CALL, payload),
        )

    async def before_tool_call(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Tool[..., Any] | None
    ) -> ToolCall | ToolOutcome:
        state = self._runs.get(info.run_id)
        if state is not None and tool is not None:
            state.sensitive[tool.name] = tool.sensitive
        if tool is not None and tool.sensitive:
            self.audit.redactor.learn([call.arguments.get(n) for n in tool.sensitive])
        return call

    def _tool_call(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, step: str, *, executed: bool
    ) -> tuple[str, AuditRecord]:
        execution = str(ULID())
        payload = {
            "turn": turn,
            "slot": slot,
            "tool": call.name,
            "call_id": call.id,
            "step": step,
            "execution": execution,
            "arguments": self._arguments(info, call),
            "executed": executed,
            "replayed": False,
        }
        return execution, self._record(info, actions.TOOL_CALL, payload)

    @staticmethod
    def _outcome(turn: int, slot: int, call: ToolCall, outcome: ToolOutcome) -> dict[str, Any]:
        result: dict[str, Any] = {
            "turn": turn,
            "slot": slot,
            "tool": call.name,
            "call_id": call.id,
            "ok": outcome.ok,
            "error_type": outcome.error_type,
            "error": outcome.error,
        }
        if outcome.ok:
            result["result"] = outcome.value
        return result

    async def tool_started(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, step: str
    ) -> None:
        # Written before the tool body runs: an execution that crashes the process is still
        # in the trail, as a tool.call with no tool.result.
        execution, record = self._tool_call(info, turn, slot, call, step, executed=True)
        state = self._runs.get(info.run_id)
        if state is not None:
            state.executions[step] = execution
        await self._write(info, record)

    async def tool_finished(
        self,
        info: RunInfo,
        turn: int,
        slot: int,
        call: ToolCall,
        outcome: ToolOutcome,
        *,
        step: str,
        executed: bool,
    ) -> None:
        state = self._runs.get(info.run_id)
        execution = state.executions.pop(step, None) if state is not None else None
        records: list[AuditRecord] = []
        if execution is None:  # answered by a hook (a denial, say): the tool did not run
            execution, record = self._tool_call(info, turn, slot, call, step, executed=False)
            records.append(record)
        result = {
            **self._outcome(turn, slot, call, outcome),
            "step": step,
            "execution": execution,
            "replayed": False,
        }
        # Written before the journal entry: if the journal write then fails, the resumed run
        # runs the tool again and the trail shows both executions.
        await self._write(info, *records, self._record(info, actions.TOOL_RESULT, result))

    async def after_tool_call(
        self,
        info: RunInfo,
        turn: int,
        slot: int,
        call: ToolCall,
        outcome: ToolOutcome,
        *,
        replayed: bool,
    ) -> None:
        if not replayed:
            return  # tool_started and tool_finished wrote it while it happened
        payload = {
            **self._outcome(turn, slot, call, outcome),
            "arguments": self._arguments(info, call),
            "replayed": True,
        }
        await self._write(info, self._record(info, actions.TOOL_REPLAY, payload))

    async def on_event(self, info: RunInfo, event: BaseModel) -> None:
        if isinstance(event, GovernanceEvent):
            record = event.accept(_GovernanceRecords(self, info))
            if record is not None:
                await self._write(info, record)

    async def run_finished(
        self, info: RunInfo, result: Any | None, error: BaseException | None
    ) -> None:
        try:
            if _console_chain(info.user_id):
                return  # refused at its start: nothing of it goes to a console chain
            if result is not None:
                payload: dict[str, Any] = {
                    "outcome": "interrupted" if result.interrupted else "completed",
                    "interruption_reason": result.interruption_reason,
                    "turns": result.turns,
                    "tokens_in": result.tokens_in,
                    "tokens_out": result.tokens_out,
                    "cost_usd": result.cost_usd,
                    "replayed_steps": result.replayed_steps,
                    "fresh_steps": result.fresh_steps,
                }
            else:
                payload = {
                    # As the metrics and spans say: a run whose caller went away or that
                    # someone cancelled did not fail (error_type tells which it was), nor
                    # did one another owner took over (claim_lost: it ends there).
                    "outcome": "failed" if error is None else end_outcome(error),
                    "error_type": type(error).__name__ if error is not None else None,
                    "error": str(error) if error is not None else None,
                }
            await self._write(info, self._record(info, actions.RUN_END, payload))
        finally:
            self._runs.pop(info.run_id, None)


def _console_chain(user_id: str | None) -> bool:
    return isinstance(user_id, str) and user_id.startswith(actions.CONSOLE_CHAINS)


@dataclass(slots=True)
class _GovernanceRecords:
    """The audit record of each governance event (a :class:`GovernanceVisitor`)."""

    hooks: AuditHooks
    info: RunInfo

    def permission_decided(self, event: PermissionDecided) -> AuditRecord:
        audit = self.hooks.audit
        if event.approver:
            actor = f"approver:{event.approver}"
        else:  # an approver who gave no name is still not the policy
            actor = "approver" if event.by_approver else f"policy:{event.policy}"
        # None for a name the model made up: every value hidden, as in its tool.call.
        sensitive = self.hooks._sensitive(self.info, event.tool)
        payload = {
            "tool": event.tool,
            "turn": event.turn,
            "slot": event.slot,
            "decision": event.decision,
            "final": event.final,
            "reason": event.reason,
            "policy": event.policy,
            "approver": event.approver,
            "arguments": audit.redactor.arguments(
                event.arguments, sensitive, max_text=audit.max_text
            ),
            "edited": event.edited,
        }
        return self.hooks._record(self.info, actions.PERMISSION_DECISION, payload, actor=actor)

    def approval_requested(self, event: ApprovalRequested) -> AuditRecord:
        audit = self.hooks.audit
        sensitive = self.hooks._sensitive(self.info, event.tool) or frozenset()
        payload = {
            "request_id": event.request_id,
            "tool": event.tool,
            "turn": event.turn,
            "slot": event.slot,
            "reason": event.reason,
            "policy": event.policy,
            "arguments": audit.redactor.arguments(
                event.arguments, sensitive, max_text=audit.max_text
            ),
        }
        return self.hooks._record(
            self.info, actions.APPROVAL_REQUEST, payload, actor=f"policy:{event.policy}"
        )

    def budget_denied(self, event: BudgetDenied) -> AuditRecord:
        payload = {
            "cap": event.cap,
            "limit": event.limit,
            "used": event.used,
            "requested": event.requested,
        }
        return self.hooks._record(self.info, actions.BUDGET_DENIED, payload, actor="budget")

    def budget_warning(self, event: BudgetWarning) -> AuditRecord:
        payload = {
            "cap": event.cap,
            "limit": event.limit,
            "used": event.used,
            "fraction": event.fraction,
        }
        return self.hooks._record(self.info, actions.BUDGET_WARNING, payload, actor="budget")

    def budget_unavailable(self, event: BudgetUnavailable) -> AuditRecord:
        payload = {"detail": event.detail}
        return self.hooks._record(self.info, actions.BUDGET_UNAVAILABLE, payload, actor="budget")

    def guardrail_tripped(self, event: GuardrailTripped) -> AuditRecord:
        payload = {
            "guardrail": event.name,
            "stage": event.stage,
            "action": event.action,
            "detail": event.detail,
        }
        return self.hooks._record(
            self.info, actions.GUARDRAIL_TRIP, payload, actor=f"guardrail:{event.name}"
        )
