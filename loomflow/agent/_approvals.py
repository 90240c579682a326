"""The agent's side of deferred approvals: list what waits, record decisions, then resume.

The journal work is :mod:`loomflow.governance.approvals`; this module adds what only the agent
knows: its journal, its tools (edited arguments are validated against the tool's schema before
anything is recorded) and its audit log (who decided what, when, with which edits).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..audit import AuditLog, actions
from ..checkpoints import checkpoint_store_for
from ..errors import ApprovalArgumentsError, CheckpointError, UserError
from ..governance.approvals import (
    PendingApproval,
    RecordedDecision,
    check_decidable,
    journal_decisions,
    normalize_decision,
    read_approvals,
)
from ..runtime._journal import JournalRuntime
from ..tools import Tool
from ._run import check_prompt, inconsistency

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["decide", "pending_of"]


def _journal(agent: Agent) -> JournalRuntime:
    if not isinstance(agent.runtime, JournalRuntime):
        raise UserError(
            "deferred approvals live in the journal: give the agent a runtime (InMemoryRuntime, "
            "SqliteRuntime or PostgresRuntime)"
        )
    return agent.runtime


async def pending_of(agent: Agent, session_id: str, user_id: str | None) -> list[PendingApproval]:
    """The requests of the session's last run that wait for a decision."""
    ledger = await read_approvals(_journal(agent), session_id, user_id)
    return ledger.pending


async def decide(
    agent: Agent,
    session_id: str,
    user_id: str | None,
    approvals: Mapping[str, object],
    decided_by: str | None,
    prompt: str,
) -> None:
    """Check, journal and audit ``approvals``; the resumed run (with ``prompt``) then
    applies them."""
    if not isinstance(approvals, Mapping):
        raise UserError(f"approvals must map request ids to decisions, not {approvals!r}")
    runtime = _journal(agent)
    ledger = await read_approvals(runtime, session_id, user_id)
    check_decidable(ledger, approvals, session_id, user_id)
    if agent.tuning.checkpoint:
        await _check_snapshot_prompt(runtime, session_id, user_id, ledger.epoch, prompt)
    recorded: dict[str, RecordedDecision] = {}
    for request_id, decision in approvals.items():
        recorded[request_id] = normalize_decision(request_id, decision, decided_by)
        edited = recorded[request_id].arguments
        if edited is not None:
            check_arguments(agent.tools.get(ledger.requests[request_id].tool), request_id, edited)
    audit = agent.audit

    async def audited(request: PendingApproval, decision: RecordedDecision) -> None:
        if isinstance(audit, AuditLog):  # before the decision is journaled (see journal_decisions)
            await audit_decision(
                audit,
                request,
                decision,
                tool_of(agent, request),
                session_id=session_id,
                user_id=user_id,
            )

    await journal_decisions(runtime, session_id, user_id, recorded, before_each=audited)


async def _check_snapshot_prompt(
    runtime: JournalRuntime, session_id: str, user_id: str | None, epoch: int | None, prompt: str
) -> None:
    """Raise the ``UserError`` the resume would raise for a snapshot of the stopped run taken
    for another prompt, before any decision is recorded: a decision is final, so the
    corrected resume would meet ``ApprovalDecidedError`` for the decisions it carries."""
    try:
        latest = await checkpoint_store_for(runtime).latest(session_id, user_id=user_id)
    except CheckpointError:
        return  # the resume replays the journal instead (see _run.latest_of_run)
    if latest is not None and latest.epoch == epoch and inconsistency(latest) is None:
        check_prompt(latest, prompt)


def tool_of(agent: Agent, request: PendingApproval) -> Tool[..., Any] | None:
    return agent.tools.get(request.tool)


def check_arguments(
    tool: Tool[..., Any] | None, request_id: str, arguments: dict[str, Any]
) -> None:
    """Raise :class:`ApprovalArgumentsError` unless ``arguments`` fit the tool's schema."""
    if tool is None:
        return  # the tool is gone from the agent: the call fails when it runs, as any unknown tool
    problem = tool.argument_problem(arguments)
    if problem is not None:
        raise ApprovalArgumentsError(
            f"approval {request_id!r}: the edited arguments do not fit tool {tool.name!r}: "
            f"{problem}",
            request_id,
        )


async def audit_decision(
    audit: AuditLog,
    request: PendingApproval,
    decision: RecordedDecision,
    tool: Tool[..., Any] | None,
    *,
    session_id: str,
    user_id: str | None,
) -> None:
    """Write ``approval.decision``: who decided what on which request, when, with which edits.

    The entry goes to the trail of ``user_id`` (the scope the request was read from and the
    decision journaled in), never to one the request record names: a record is data.

    Edited values are redacted under the sensitive names the request recorded (the tool was
    known when the run asked), and the tool's own when it is at hand: the command line decides
    without the tool, and its audit entry must hide the same values.
    """
    sensitive = frozenset(request.sensitive) | (tool.sensitive if tool is not None else frozenset())
    edited = decision.arguments
    await audit.record(
        actions.APPROVAL_DECISION,
        user_id=user_id,
        session_id=session_id,
        run_id=request.run_id or None,
        actor=f"approver:{decision.decided_by}" if decision.decided_by else "approver",
        payload={
            "request_id": request.request_id,
            "tool": request.tool,
            "decision": decision.behavior,
            "reason": decision.reason,
            "decided_by": decision.decided_by,
            "decided_at": decision.decided_at,
            "edited": edited is not None,
            "arguments": (
                audit.redactor.arguments(edited, sensitive, max_text=audit.max_text)
                if edited is not None
                else None
            ),
        },
    )
