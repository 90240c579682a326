"""``loomflow approvals list|approve|deny``: tool calls that wait for a person.

Runs with ``StandardPermissions(approval="defer")`` stop at a call that needs approval and
journal the request. These commands read the requests from the journal (``--url`` or
``LOOMFLOW_RUNTIME_URL``) and journal decisions there, with an ``approval.decision`` entry in
the audit log (``LOOMFLOW_AUDIT_URL``, else beside the journal). They do not continue the run:
the command line has no agent to run it with. The application's next
``agent.resume(prompt, session_id=..., user_id=...)`` (no ``approvals=`` needed) applies the
recorded decision; until then ``approvals list`` no longer shows the request.

Edited arguments (``--arguments``) must be a JSON object; the tool's own schema is checked when
the resumed run calls the tool (a mismatch reaches the model as an invalid-arguments error).
``agent.resume(approvals=...)`` checks the schema before recording anything. The audit entry
redacts the edited values of the argument names the request recorded as sensitive. A run that
was cancelled while it waited refuses the decision (``RunCancelledError``, exit status 1).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from .._ids import check_id
from .._printable import is_unicode, shown
from .._timefmt import holdable_seconds, parse_time
from ..agent._approvals import audit_decision
from ..audit import AuditLog
from ..config import Settings
from ..errors import InvalidArgumentError, InvalidIdError
from ..governance.approvals import (
    Approve,
    DamagedRequest,
    Deny,
    PendingApproval,
    RecordedDecision,
    journal_decisions,
    normalize_decision,
    read_approvals,
)
from ..redaction import Redactor
from ..runtime import RUN_STATES, JournalRuntime, SessionInfo
from ..runtime._states import UNREADABLE
from ..stores import Stores
from ._format import (
    id_cell,
    iso_time,
    login,
    positive_int,
    printable,
    table,
    table_iso,
    user_cell,
    who,
)
from ._stores import existing, session_of

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add the ``approvals`` command group to the CLI."""
    group = subparsers.add_parser(
        "approvals", help="list, approve or deny tool calls that wait for a person"
    )
    commands = group.add_subparsers(dest="approvals_command", required=True)

    listing = commands.add_parser("list", help="requests waiting for a decision")
    listing.add_argument("--user", dest="user_id", help="only this user's sessions")
    listing.add_argument("--session", dest="session_id", help="only this session")
    listing.add_argument(
        "--limit",
        type=positive_int,
        default=100,
        help="look at the N most recent sessions not finished or cancelled (100)",
    )
    listing.add_argument("--json", action="store_true", help="JSON lines for scripts")

    for name, helptext in (
        ("approve", "allow a waiting call (optionally with edited arguments)"),
        ("deny", "refuse a waiting call; the reason reaches the model"),
    ):
        command = commands.add_parser(name, help=helptext)
        command.add_argument("request_id")
        command.add_argument("--session", dest="session_id", required=True)
        who = command.add_mutually_exclusive_group()
        who.add_argument(
            "--user", dest="user_id", help="whose session (needed when several users share the id)"
        )
        who.add_argument("--anonymous", action="store_true", help="the session without a user")
        command.add_argument(
            "--by",
            dest="decided_by",
            help="who decides, for the journal and the audit log (default: cli:<login>)",
        )
        command.add_argument(
            "--reason", required=name == "deny", default="", help="why (shown to the model)"
        )
        if name == "approve":
            command.add_argument(
                "--arguments", help="a JSON object to run the tool with instead of the model's"
            )
        command.add_argument("--json", action="store_true")

    group.set_defaults(handler=_handle)


async def _handle(args: argparse.Namespace) -> int:
    settings = Settings()
    url = existing(args.url or settings.runtime_url, "journal")
    async with Stores(settings.model_copy(update={"runtime_url": url})) as stores:
        runtime = stores.runtime
        assert runtime is not None  # Stores has a journal by default
        if args.approvals_command == "list":
            return await _list(runtime, args)
        decision: Approve | Deny
        if args.approvals_command == "approve":
            decision = Approve(arguments=_edited(args.arguments), reason=args.reason)
        else:
            decision = Deny(args.reason)
        # Without --by, still name the person at the terminal (as `runs cancel` does): the
        # audit actor becomes approver:cli:<login>, never a bare "approver".
        decided_by = _approver(args.decided_by)
        recorded = normalize_decision(args.request_id, decision, decided_by)
        # Which user's session: the journal knows who ran it when only one user did.
        info = await session_of(runtime, args.session_id, args.user_id, anonymous=args.anonymous)
        args.user_id = info.user_id
        audit = AuditLog(stores.audit, redactor=Redactor.from_settings(settings), redact_logs=False)

        async def audited(request: PendingApproval, decision: RecordedDecision) -> None:
            # No tool here: the request's recorded sensitive names redact the edited values.
            # Filed under the scope the decision is journaled in, not one the record names;
            # written before the decision is journaled, so an unaudited one never takes effect.
            await audit_decision(
                audit, request, decision, None, session_id=args.session_id, user_id=args.user_id
            )

        decided = await journal_decisions(
            runtime, args.session_id, args.user_id, {args.request_id: recorded}, audited
        )
        request = decided[args.request_id]
        summary = {
            "request_id": request.request_id,
            "session_id": args.session_id,
            "user_id": args.user_id,
            "tool": request.tool,
            "decision": recorded.behavior,
            "decided_by": recorded.decided_by,
            "decided_at": _iso(recorded.decided_at),
        }
        if args.json:
            print(json.dumps(summary))
        else:
            # The tool name is read back from the journal: a crafted row may hold escapes.
            print(
                f"{recorded.behavior} recorded for {request.request_id} "
                f"({printable(request.tool)}) in "
                f"session {args.session_id!r} of {who(args.user_id)}; the application's "
                "next resume() of that session applies it"
            )
        return 0


def _approver(given: str | None) -> str:
    """``--by``, else ``cli:<login>``; an error names which of them breaks the id rules.

    An empty ``--by`` (a script's unset variable) is refused, not taken for no ``--by``: the
    decision would be audited as the login of whoever ran the script."""
    if given is not None:
        try:
            return str(check_id("--by", given, optional=False))
        except InvalidIdError as exc:
            raise InvalidIdError("--by", exc.reason) from None
    name = login()
    try:
        return str(check_id("decided_by", f"cli:{name}", optional=False))
    except InvalidIdError as exc:
        raise InvalidIdError(
            "--by",
            f"is needed: your login name {shown(name, 80)} cannot name the approver "
            f"(cli:<login> {exc.reason})",
        ) from None


def _edited(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKeyError as exc:
        raise InvalidArgumentError(
            f"--arguments names {exc.args[0]!r} twice; give each argument once"
        ) from None
    except RecursionError:
        raise InvalidArgumentError("--arguments is nested too deeply") from None
    except ValueError as exc:  # not JSON, or an integer past Python's digit limit
        raise InvalidArgumentError(f"--arguments is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(
            f"--arguments must be a JSON object of argument names to values, not "
            f"{type(value).__name__}"
        )
    return value


class _DuplicateKeyError(ValueError):
    """An object of ``--arguments`` names a key twice (JSON keeps the last, silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for key, item in pairs:
        if key in value:
            raise _DuplicateKeyError(key)
        value[key] = item
    return value


async def _list(runtime: JournalRuntime, args: argparse.Namespace) -> int:
    filters: dict[str, Any] = {"limit": args.limit}
    if args.user_id is not None:
        filters["user_id"] = args.user_id
    if args.session_id is not None:
        filters["session_id"] = args.session_id
    pending: list[PendingApproval] = []
    # A request row edited by hand is listed as unreadable, with why, instead of vanishing:
    # the run's resume stops at it, and `approve` refuses it.
    damaged: list[DamagedRequest] = []
    for session in await _waiting_sessions(runtime, filters):
        if session.session_id is None:
            continue
        if not all(is_unicode(v) for v in (session.session_id, session.user_id or "")):
            # A session row holding text that is not UTF-8 (see storage/_sqlite.read_text):
            # no request of it can be looked up by those ids, so say so instead of failing.
            why = "its session row holds a session or user id that is not UTF-8 text"
            damaged.append(DamagedRequest("-", None, session.session_id, session.user_id, why))
            continue
        try:
            ledger = await read_approvals(runtime, session.session_id, session.user_id)
        except InvalidIdError as exc:
            # A hand-edited session row (a control character in its id): its requests cannot
            # be looked up, and it must not hide every other session's (the listing failed).
            why = f"its session row holds an id no session can have ({exc})"
            damaged.append(DamagedRequest("-", None, session.session_id, session.user_id, why))
            continue
        pending.extend(ledger.pending)
        if not ledger.cancelled:
            damaged.extend(ledger.damaged)
    if args.json:
        for request in pending:
            row = request.model_dump(mode="json")
            row["requested_at"] = _iso(request.requested_at)
            print(json.dumps(row))
        for bad in damaged:
            print(json.dumps(_unreadable(bad)))
        return 0
    if not pending and not damaged:
        print("no approval requests are waiting")
        return 0
    rows: list[tuple[Any, ...]] = [
        ("request", "session", "user", "tool", "arguments", "requested (UTC)", "reason")
    ]
    for r in pending:
        shown = json.dumps(r.arguments, ensure_ascii=False)
        rows.append(
            (
                r.request_id,
                id_cell(r.session_id),
                user_cell(r.user_id),
                r.tool,
                shown if len(shown) <= 60 else shown[:57] + "...",
                table_iso(_iso(r.requested_at)),
                r.reason if len(r.reason) <= 60 else r.reason[:57] + "...",
            )
        )
    for bad in damaged:
        rows.append(
            (
                _cut(bad.request_id) if bad.request_id is not None else "-",
                id_cell(bad.session_id),
                user_cell(bad.user_id),
                "unreadable",
                "-",
                "-",
                "-",
            )
        )
    table(rows)
    for bad in damaged:
        print(f"loomflow: {printable(_warning(bad))}", file=sys.stderr)
    return 0


# Run states whose requests wait for nothing (Ledger.pending is empty for both).
_DONE_STATES = ("finished", "cancelled")


async def _waiting_sessions(runtime: JournalRuntime, filters: dict[str, Any]) -> list[SessionInfo]:
    """The ``limit`` most recent sessions whose last run may still wait for a decision.

    Finished and cancelled runs are left out before the limit applies: on a busy journal the
    most recent sessions are mostly finished, and counting them hid the ones that wait.
    """
    found: list[SessionInfo] = []
    for state in (*RUN_STATES, UNREADABLE):
        if state not in _DONE_STATES:
            found.extend(await runtime.sessions(**filters, state=state))
    # A hand-edited time (NaN) would leave the order undefined: such rows go last.
    found.sort(
        key=lambda s: s.updated_at if holdable_seconds(s.updated_at) else -math.inf, reverse=True
    )
    return found[: filters["limit"]]


def _cut(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _unreadable(bad: DamagedRequest) -> dict[str, Any]:
    """A damaged request as a JSON line: what its row still tells, and why it is unreadable."""
    return {
        "request_id": bad.request_id,
        "session_id": bad.session_id,
        "user_id": bad.user_id,
        "step": bad.step,
        "unreadable": bad.problem,
    }


def _warning(bad: DamagedRequest) -> str:
    name = f"approval request {_cut(bad.request_id)!r}" if bad.request_id else "an approval request"
    return (
        f"{name} (journal entry {bad.step!r}) of session {bad.session_id!r} of "
        f"{who(bad.user_id)} is unreadable: {bad.problem}; it cannot be decided, and a resume "
        "of the run stops at it"
    )


def _iso(text: str) -> str | None:
    """A journaled request or decision time in the one format of the CLI's times (the
    journal keeps what the run wrote: ``+00:00`` from runs of earlier 0.21 builds); ``None``
    for text that is no time (a hand-edited record), never that text where a time goes. A
    record without a time (``""``, the field's default) keeps saying so."""
    if not text:
        return text
    try:
        return iso_time(parse_time(text))
    except InvalidArgumentError:
        return None
