"""Cancelling a run from anywhere, with an audit entry naming who asked."""

from __future__ import annotations

from ..audit import AuditLog
from ..audit.actions import RUN_CANCEL
from ..runtime import JournalRuntime

__all__ = ["cancel_run"]


async def cancel_run(
    runtime: JournalRuntime,
    session_id: str,
    *,
    user_id: str | None = None,
    audit: AuditLog | None = None,
    actor: str = "api",
) -> bool:
    """Cancel the open or interrupted run of (session, user) and, if one was cancelled, audit it.

    The process running it stops at its next step boundary with
    :class:`~loomflow.errors.RunCancelledError`; the run is never recovered, and a run that
    waited for approval is never resumed (deciding or resuming it raises that error). Returns
    ``False`` (and audits nothing) when the session has no such run (finished, say). See
    :meth:`JournalRuntime.cancel <loomflow.runtime.JournalRuntime.cancel>`.
    """
    cancelled = await runtime.cancel(session_id, user_id)
    if cancelled and audit is not None:
        await audit.record(
            RUN_CANCEL, user_id=user_id, session_id=session_id, actor=actor, payload={}
        )
    return cancelled
