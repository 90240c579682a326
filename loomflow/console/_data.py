"""What the console reads, through :class:`~loomflow.stores.Stores`, and the audit of reading.

Every query the console serves is first written to the audit log as ``console.query``, in
the chain of the person who asked (user id ``console:<name>``), not in the chain of the user
looked at. Written there, looking at a trail never changes it: a trail exported twice is
the same export, and its verification stays what it was. Who looked at whose trail is a
query away: ``loomflow audit query --action console.query`` lists every look, the viewed
user in each entry's payload. The write happens before anything is read, so a console
that cannot audit serves nothing.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..audit import ANY_USER, AuditEntry, AuditPage, AuditRecord, ChainHead, VerifyReport
from ..audit._store import AuditFilter
from ..audit.actions import CONSOLE_CHAINS, RUN_END
from ..errors import JournalError, LoomflowError
from ..redaction import Redactor
from ..runtime import EntryInfo, SessionInfo
from ..stores import Stores
from ._access import Principal

__all__ = [
    "CONSOLE_ACTION",
    "CONSOLE_REFUSED",
    "CONSOLE_SIGNIN",
    "ConsoleData",
    "RunStory",
    "TrailFilter",
    "console_user_id",
]

CONSOLE_ACTION = "console.query"
"""The audit action of a query the console served."""
CONSOLE_SIGNIN = "console.signin"
"""The audit action of a sign-in through the form (a session cookie was handed out)."""
CONSOLE_REFUSED = "console.refused"
"""The audit action of a request refused for want of a role (a reader asking for admin work)."""

# Actions that make a run's story, grouped as the run page shows them.
_EXECUTED = ("model.call", "tool.call")
_REPLAYED = ("model.replay", "tool.replay")
_EXPORT_CHUNK = 1000  # lines per chunk of a streamed export
_STORY_LIMIT = 2000  # entries of one run shown; a longer run says so


def console_user_id(principal: Principal) -> str:
    """The audit chain a console user's own queries go to."""
    return f"{CONSOLE_CHAINS}{principal.name}"


def _state_of_run(entries: list[AuditEntry], session_state: str) -> str:
    """A run's own state: what its ``run.end`` says when it returned, else its session's.

    The session row describes the session's latest run; an older run of a reused session
    that returned keeps the outcome it returned with.
    """
    for entry in reversed(entries):
        if entry.action == RUN_END and isinstance(entry.payload, dict):
            outcome = entry.payload.get("outcome")
            if outcome == "completed":
                return "finished"
            if outcome == "interrupted":
                # A run waiting for approval may be cancelled after it returned.
                return "cancelled" if session_state == "cancelled" else "interrupted"
            break  # it raised: open, resumed since, cancelled... the session row knows
    return session_state


@dataclass(frozen=True, slots=True)
class TrailFilter:
    """The filters of a trail page (and of its export)."""

    since: dt.datetime | None = None
    until: dt.datetime | None = None
    session_id: str | None = None
    action: str | None = None

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "since": self.since,
            "until": self.until,
            "session_id": self.session_id,
            "action": self.action,
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "since": None if self.since is None else self.since.isoformat(),
            "until": None if self.until is None else self.until.isoformat(),
            "session": self.session_id,
            "action": self.action,
        }


@dataclass
class RunStory:
    """One run told from its audit entries and its journal."""

    user_id: str | None
    run_id: str
    entries: list[AuditEntry]
    truncated: bool
    session: SessionInfo | None
    state: str | None
    journal: list[EntryInfo] = field(default_factory=list)

    @property
    def session_id(self) -> str | None:
        for entry in self.entries:
            if entry.session_id is not None:
                return entry.session_id
        return None

    def count(self, actions: tuple[str, ...]) -> int:
        return sum(1 for e in self.entries if e.action in actions)

    @property
    def executed(self) -> int:
        return self.count(_EXECUTED)

    @property
    def replayed(self) -> int:
        return self.count(_REPLAYED)

    @property
    def decisions(self) -> list[AuditEntry]:
        """Permission and budget decisions, in order."""
        return [
            e
            for e in self.entries
            if e.action == "permission.decision" or e.action.startswith("budget.")
        ]

    @property
    def cost_usd(self) -> float:
        """What the run's live model calls cost (replays cost nothing)."""
        total = 0.0
        for entry in self.entries:
            if entry.action == "model.call":
                cost = (entry.payload or {}).get("cost_usd")
                if isinstance(cost, int | float) and not isinstance(cost, bool):
                    total += float(cost)
        return total

    def to_json(self) -> dict[str, Any]:
        return {
            "user_id": self.user_id,
            "run_id": self.run_id,
            "session_id": self.session_id,
            "state": self.state,
            "executed": self.executed,
            "replayed": self.replayed,
            "cost_usd": self.cost_usd,
            "truncated": self.truncated,
            "decisions": [e.to_json() for e in self.decisions],
            "entries": [e.to_json() for e in self.entries],
            "journal": [
                {"path": list(j.path), "name": j.name, "kind": j.kind, "epoch": j.epoch}
                for j in self.journal
            ],
        }


class ConsoleData:
    """The console's reads over one deployment's stores, each one audited first."""

    def __init__(self, stores: Stores, redactor: Redactor) -> None:
        self.stores = stores
        self.redactor = redactor

    async def record(
        self,
        principal: Principal,
        what: str,
        *,
        viewed: str | Any | None = ANY_USER,
        details: dict[str, Any] | None = None,
        action: str = CONSOLE_ACTION,
    ) -> None:
        """Write one console query (or refusal) to the asker's own audit chain."""
        payload: dict[str, Any] = {"query": what, "role": principal.role, "via": principal.via}
        if viewed is not ANY_USER:
            payload["viewed_user"] = viewed
        if details:
            payload["details"] = details
        who = console_user_id(principal)
        await self.stores.audit.append(
            AuditRecord(
                user_id=who,
                actor=who,
                action=action,
                payload=self.redactor.value(payload),
            )
        )

    async def users(self, search: str = "", limit: int = 200) -> tuple[list[ChainHead], bool]:
        """Users the audit log knows (their chain heads), those whose id contains ``search``
        (case-insensitive); and whether there were more than ``limit``."""
        needle = search.casefold()
        found = [h for h in await self.stores.audit.heads() if needle in str(h.user_id).casefold()]
        found.sort(key=lambda h: (h.user_id is not None, h.user_id or ""))
        return found[:limit], len(found) > limit

    async def trail(
        self, user_id: str | None, where: TrailFilter, *, limit: int, cursor: str | None
    ) -> AuditPage:
        return await self.stores.audit.query(
            user_id=user_id, **where.as_kwargs(), limit=limit, cursor=cursor
        )

    async def entry(self, user_id: str | None, seq: int) -> AuditEntry | None:
        """The user's entry ``seq`` (entries are stored in seq order: stop once past it)."""
        async for entry in self.stores.audit.entries(user_id=user_id):
            if entry.seq == seq:
                return entry
            if entry.seq > seq:
                break
        return None

    async def verify(self, user_id: str | Any | None = ANY_USER) -> VerifyReport:
        return await self.stores.audit.verify(user_id=user_id)

    @staticmethod
    def export_header(user_id: str | None, where: TrailFilter) -> str:
        """The first line of an export of this user's trail (as ``loomflow audit export
        --user`` writes it): it names the filters, so the export is checked against this
        user's saved heads and no one else's."""
        header = AuditFilter.build(user_id=user_id, **where.as_kwargs()).export_header()
        assert header is not None  # a user is always a filter
        return header + "\n"

    async def export_lines(self, user_id: str | None, where: TrailFilter) -> AsyncIterator[str]:
        """The selected entries as the lines of ``loomflow audit export``, one page at a time."""
        lines: list[str] = [self.export_header(user_id, where)]
        async for entry in self.stores.audit.entries(user_id=user_id, **where.as_kwargs()):
            lines.append(entry.to_line() + "\n")
            if len(lines) == _EXPORT_CHUNK:
                yield "".join(lines)
                lines = []
        if lines:
            yield "".join(lines)

    async def run(self, user_id: str | None, run_id: str) -> RunStory:
        entries: list[AuditEntry] = []
        truncated = False
        async for entry in self.stores.audit.entries(user_id=user_id, run_id=run_id):
            if len(entries) == _STORY_LIMIT:
                truncated = True
                break
            entries.append(entry)
        story = RunStory(user_id, run_id, entries, truncated, None, None)
        runtime = self.stores.runtime
        session_id = story.session_id
        if runtime is not None and entries:
            try:
                found = await runtime.sessions(user_id=user_id, session_id=session_id, limit=1)
                if found:
                    story.session = found[0]
                    story.state = _state_of_run(entries, found[0].state)
                    story.journal = await runtime.entries(session_id, user_id)
            except LoomflowError:
                # No journal schema here (an audit-only database): the audit entries still
                # tell the story; the page says the run is not in the journal.
                pass
        return story

    async def runs(self, state: str | None, limit: int = 500) -> list[tuple[SessionInfo, str]]:
        """The journal's runs, most recent first, with their state (``state`` keeps one)."""
        runtime = self.stores.runtime
        if runtime is None:
            return []
        try:
            sessions = await runtime.sessions(limit=limit, state=state)
        except LoomflowError as exc:
            raise JournalError(
                "the journal cannot be read here: the console never creates or migrates it "
                f"(run `loomflow migrate` if this database should hold one) ({exc})"
            ) from exc
        listed = [(info, info.state) for info in sessions]
        return [(i, s) for i, s in listed if state is None or s == state]
