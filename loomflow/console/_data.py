"""What the console reads, through :class:`~loomflow.stores.Stores`, and the audit of reading.

Every query the console serves is first written to the audit log as ``console.query``, in
the chain of the person who asked (user id ``console:<name>``), not in the chain of the user
looked at. Written there, looking at a trail never changes it: a trail exported twice is
the same export, and its verification stays what it was. Who looked at whose trail is a
query away: ``loomflow audit query --action console.query`` lists every look, the viewed
user in each entry's payload. The write happens before anything is read, so a console
that cannot audit serves nothing.

Every payload the console shows, on a page or under ``/api/``, is read through
:meth:`ConsoleData.shown`, which passes it through the deployment's redaction: a writer that
did not redact, or a secret configured after an entry was written, is not shown either. Only
the admin export (:meth:`ConsoleData.export_page`, :meth:`ConsoleData.export_lines`) hands
out payloads as stored, since that is what their hashes cover.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from .._timefmt import iso_time
from ..audit import (
    ANY_USER,
    AuditEntry,
    AuditPage,
    AuditRecord,
    ChainHead,
    ChainProblem,
    VerifyReport,
)
from ..audit._store import AuditFilter, export_line
from ..audit.actions import CONSOLE_CHAINS, RUN_END
from ..errors import AuditIntegrityError, JournalError, LoomflowError, UserError
from ..redaction import Redactor
from ..runtime import EntryInfo, SessionInfo
from ..stores import Stores
from ._access import Principal

__all__ = [
    "CONSOLE_ACTION",
    "CONSOLE_REFUSED",
    "CONSOLE_SIGNIN",
    "CONSOLE_SIGNIN_FAILED",
    "CONSOLE_SIGNOUT",
    "SIGNIN_FAILURES_CHAIN",
    "ConsoleData",
    "RunStory",
    "SignInFailures",
    "TrailFilter",
    "console_user_id",
    "names_no_user",
]

CONSOLE_ACTION = "console.query"
"""The audit action of a query the console served."""
CONSOLE_SIGNIN = "console.signin"
"""The audit action of a sign-in through the form (a session cookie was handed out)."""
CONSOLE_SIGNOUT = "console.signout"
"""The audit action of a sign-out through the form (a live sign-in was ended)."""
CONSOLE_REFUSED = "console.refused"
"""The audit action of a request refused for want of a role (a reader asking for admin work);
it names the user the request was about, as ``console.query`` does."""
CONSOLE_SIGNIN_FAILED = "console.signin_failed"
"""The audit action of failed sign-ins (an unknown token, typed or sent as a bearer, or a
proxy header whose value is no name), coalesced: see :class:`SignInFailures`."""
SIGNIN_FAILURES_CHAIN = f"{CONSOLE_CHAINS}(unknown)"
"""The chain failed sign-ins go to: nobody signed in to own them, and no name a token or the
proxy header can carry has parentheses, so it is no one's chain."""

log = logging.getLogger("loomflow.console")

# Actions that make a run's story, grouped as the run page shows them.
_EXECUTED = ("model.call", "tool.call")
_REPLAYED = ("model.replay", "tool.replay")
_EXPORT_CHUNK = 1000  # lines per chunk of a streamed export
_STORY_LIMIT = 2000  # entries of one run shown; a longer run says so


def names_no_user(head: ChainHead | ChainProblem) -> bool:
    """Whether a head row listed on the users page is one whose key names no trail."""
    return isinstance(head, ChainProblem) and head.kind == "unreadable"


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
            "since": iso_time(self.since),
            "until": iso_time(self.until),
            "session": self.session_id,
            "action": self.action,
        }


@dataclass
class RunStory:
    """One run told from its audit entries and its journal.

    ``rows``: the run's rows in storage order, each an entry (as shown) or, for a row that
    reads as no entry, the ``unreadable`` problem standing in its place (as an export marks
    it); ``entries`` are the readable ones. ``report``: the verification of the user's trail,
    made when a row of the run is damaged, so that the page never passes for a sound one.
    """

    user_id: str | None
    run_id: str
    entries: list[AuditEntry]
    truncated: bool
    session: SessionInfo | None
    state: str | None
    journal: list[EntryInfo] = field(default_factory=list)
    rows: list[AuditEntry | ChainProblem] = field(default_factory=list)
    report: VerifyReport | None = None

    @property
    def damaged(self) -> list[ChainProblem]:
        """The run's rows that read as no entry."""
        return [row for row in self.rows if isinstance(row, ChainProblem)]

    @property
    def unreadable(self) -> bool:
        """Whether a row of the run is damaged: one that reads as no entry, or an entry whose
        payload cannot be read."""
        return bool(self.damaged) or any(e.unreadable is not None for e in self.entries)

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
        data: dict[str, Any] = {
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
                {
                    "path": list(j.path),
                    "name": j.name,
                    "kind": j.kind,
                    "epoch": j.epoch,
                    "size": j.size,
                    "created_at": iso_time(j.created_at),
                }
                for j in self.journal
            ],
        }
        # Only for a damaged run, as the trail's answer adds them: an intact run's answer
        # stays as it was.
        if self.damaged:
            data["damaged"] = [p.to_json() for p in self.damaged]
        if self.report is not None:
            data["verify"] = self.report.to_json()
        return data


_MAX_CLIENTS = 8  # client addresses kept per failed sign-in record


@dataclass
class _Failures:
    """Failed sign-ins not yet written: how many, by which way in, from where, when."""

    first: float  # Unix seconds
    last: float
    count: int = 0
    via: dict[str, int] = field(default_factory=dict)
    clients: list[str] = field(default_factory=list)
    more_clients: bool = False

    def add(self, via: str, client: str | None, when: float) -> None:
        self.count += 1
        self.last = when
        self.via[via] = self.via.get(via, 0) + 1
        self._client(client)

    def merge(self, other: _Failures) -> None:
        self.first, self.last = min(self.first, other.first), max(self.last, other.last)
        self.count += other.count
        for via, n in other.via.items():
            self.via[via] = self.via.get(via, 0) + n
        for client in other.clients:
            self._client(client)
        self.more_clients = self.more_clients or other.more_clients

    def _client(self, client: str | None) -> None:
        if client is None or client in self.clients:
            return
        if len(self.clients) < _MAX_CLIENTS:
            self.clients.append(client)
        else:
            self.more_clients = True

    def payload(self) -> dict[str, Any]:
        # Never the token, the header's value or the address asked for: a wrong token may be
        # someone's real one mistyped, and a path may name a user (whom a forget could not
        # find here, since these entries view no one).
        return {
            "failures": self.count,
            "via": dict(sorted(self.via.items())),
            "first": iso_time(self.first),
            "last": iso_time(self.last),
            "clients": self.clients,
            "more_clients": self.more_clients,
        }


class SignInFailures:
    """Failed sign-ins, coalesced into at most one audit entry per ``window`` seconds.

    Why coalesce rather than drop: a flood of bad tokens (a scanner, a script with a revoked
    token) must not grow the audit log without bound, yet how many failures there were is
    the very thing to know. So the first failure after a quiet ``window`` is written at once
    (a lone mistyped token shows up immediately), and the failures that follow within the
    window are counted and written together with the next failure after it, or when the
    console stops. With the default minute that is at most 1,440 entries a day per console
    process, however hard it is hammered. The price: the tail of a burst is written late
    (with the next failure, or at shutdown), and a crash loses what was counted since the
    last record. A timer could write it sooner, but would be one more task to run and stop
    for a count that is never wrong, only late.

    Args:
        window: Seconds between two records.
        clock: Monotonic seconds (a test's clock).
        wall: Unix seconds, for the times recorded.
    """

    def __init__(
        self,
        window: float = 60.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.window = window
        self.clock = clock
        self.wall = wall
        self._written: float | None = None  # clock() of the last record
        self._pending: _Failures | None = None

    def note(self, via: str, client: str | None) -> _Failures | None:
        """Count one failure; what to write now (``None``: it waits for the window)."""
        now, when = self.clock(), self.wall()
        tally = self._pending or _Failures(when, when)
        tally.add(via, client, when)
        if self._written is not None and now - self._written < self.window:
            self._pending = tally
            return None
        self._pending, self._written = None, now
        return tally

    def take(self) -> _Failures | None:
        """What is counted and not written yet (the console is stopping)."""
        tally, self._pending = self._pending, None
        return tally

    def put_back(self, tally: _Failures) -> None:
        """A tally whose write failed: counted again with the next one."""
        if self._pending is not None:
            tally.merge(self._pending)
        self._pending = tally


class ConsoleData:
    """The console's reads over one deployment's stores, each one audited first."""

    def __init__(
        self, stores: Stores, redactor: Redactor, *, failures: SignInFailures | None = None
    ) -> None:
        self.stores = stores
        self.redactor = redactor
        self.failures = failures if failures is not None else SignInFailures()

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
        redacted = self.redactor.value(payload)
        # User ids stay as given: they are the keys of trails, kept in clear in every entry,
        # and "who looked at alice@example.com?" must find them (an e-mail-shaped id would
        # otherwise read [REDACTED:email], and a card-shaped customer number [REDACTED:card]).
        if viewed is not ANY_USER:
            redacted["viewed_user"] = viewed
        if details and "search" in details:  # the users page's search: part of an id
            redacted["details"]["search"] = details["search"]
        await self.stores.audit._write(
            AuditRecord(user_id=who, actor=who, action=action, payload=redacted)
        )

    async def signin_failed(self, via: str, client: str | None) -> None:
        """Count a failed sign-in, and write the failures counted so far when it is time
        (see :class:`SignInFailures`). A write that fails is logged and counted again with
        the next: the sign-in is refused either way."""
        tally = self.failures.note(via, client)
        if tally is not None:
            await self._write_failures(tally)

    async def flush_failures(self) -> None:
        """Write the failed sign-ins counted but not written yet (the console is stopping)."""
        tally = self.failures.take()
        if tally is not None:
            await self._write_failures(tally)

    async def _write_failures(self, tally: _Failures) -> None:
        record = AuditRecord(
            user_id=SIGNIN_FAILURES_CHAIN,
            actor=SIGNIN_FAILURES_CHAIN,
            action=CONSOLE_SIGNIN_FAILED,
            payload=self.redactor.value(tally.payload()),
        )
        try:
            await self.stores.audit._write(record)
        except LoomflowError as exc:
            self.failures.put_back(tally)
            log.warning("could not record %d failed console sign-in(s): %s", tally.count, exc)

    async def users(
        self, search: str = "", limit: int = 200
    ) -> tuple[list[tuple[ChainHead | ChainProblem, str | None]], bool]:
        """Users the audit log knows (their chain heads), those whose id contains ``search``
        (case-insensitive), each with what is wrong with it (see :meth:`head_problem`); and
        whether there were more than ``limit``.

        A head row that reads as no head is listed as its problem (see
        :meth:`~loomflow.audit.AuditStore.iter_head_rows`), flagged: one damaged user does not
        hide every other one. One whose key names no user is listed when nothing is searched
        for, last (it has no id to contain the text).
        """
        needle = search.casefold()
        audit = self.stores.audit
        # Read page by page until one more than the page shows has matched: a log that knows
        # 300,000 users lists its first ones at once, and a search holds only its matches.
        # The runs without a user have no id to contain the text (not "None"): they are
        # listed, first, when nothing is searched for, so they are looked up by themselves.
        found: list[ChainHead | ChainProblem] = []
        if not needle:
            try:
                anonymous = await audit.head(None)
            except AuditIntegrityError as exc:  # its head row was edited: flagged, listed
                found.append(ChainProblem(None, "head_mismatch", None, None, str(exc)))
            else:
                found += [] if anonymous is None else [anonymous]
        async for head in audit.iter_head_rows():
            if len(found) > limit:
                break
            named = head.user_id is not None and needle in head.user_id.casefold()
            if named or (not needle and names_no_user(head)):
                found.append(head)

        def order(head: ChainHead | ChainProblem) -> tuple[int, str]:
            if head.user_id is not None:
                return 1, head.user_id
            return (2, "") if names_no_user(head) else (0, "")

        found.sort(key=order)
        return [(h, await self.head_problem(h)) for h in found[:limit]], len(found) > limit

    async def head_problem(self, head: ChainHead | ChainProblem) -> str | None:
        """Why the entries stored under a head's user do not bear it out (``None``: they do);
        for a head row that reads as no head, why.

        No hash covers a head row, so the search does not take its word for the user: the
        trail's first entry, whose user id its own hash covers, must be stored under it and
        name that user. (Only ``verify`` walks the whole trail.)
        """
        if isinstance(head, ChainProblem):
            return f"{head.detail:.300} (verify to see the whole trail)"
        if head.seq < 1:  # a trail's first entry is 1: no writer records a head before it
            return f"its recorded head counts {head.seq} entries: the head was edited"
        try:
            page = await self.stores.audit.query(user_id=head.user_id, limit=1)
        except UserError as exc:  # a head row under a key no writer makes: not a 400 for all
            return f"its user id is no id an entry can have ({exc})"
        if page.damaged:
            # The first row is there but reads as no entry: not a head edited or entries
            # deleted, which an empty page would otherwise be taken for.
            return (
                f"its first entry cannot be read: {page.damaged[0].detail:.200} (verify to see "
                "the whole trail)"
            )
        if not page.entries:
            return (
                f"its recorded head counts {head.seq} entries, but none is stored under this "
                "user: the head was edited, or the entries deleted (verify to see which)"
            )
        named = page.entries[0].user_id
        if named != head.user_id:
            return (
                f"its first entry names user {named!r:.80}: entries were filed under "
                "another user's trail (verify to see which)"
            )
        return None

    def shown(self, entry: AuditEntry) -> AuditEntry:
        """``entry`` as the console shows it: its payload passed through the deployment's
        redaction (``LOOMFLOW_REDACT_*``).

        When the redaction changed the payload, the copy has no ``payload_salt``: the shown
        payload no longer matches the digest anyway, and with the salt a reader could test
        guesses of what was hidden against the digest, offline. Hash, digest and links stay,
        so the entry's place in its chain is still shown.
        """
        if entry.payload is None:  # erased
            return entry
        payload = self.redactor.value(entry.payload)
        if payload == entry.payload:
            return entry
        return entry.model_copy(update={"payload": payload, "payload_salt": None})

    async def trail(
        self, user_id: str | None, where: TrailFilter, *, limit: int, cursor: str | None
    ) -> AuditPage:
        """One page of the user's trail, as shown (redacted; see :meth:`shown`)."""
        page = await self.export_page(user_id, where, limit=limit, cursor=cursor)
        return AuditPage([self.shown(e) for e in page.entries], page.next_cursor, page.damaged)

    async def export_page(
        self, user_id: str | None, where: TrailFilter, *, limit: int, cursor: str | None
    ) -> AuditPage:
        """One page of the user's trail as stored, unredacted: for the admin export only.

        A row that reads as no entry is in the page's ``damaged`` (and in its place in
        ``rows``), as ``loomflow audit query`` lists it: the rest of the page is still shown.
        """
        return await self.stores.audit.query(
            user_id=user_id, **where.as_kwargs(), limit=limit, cursor=cursor
        )

    async def entry(self, user_id: str | None, seq: int) -> AuditEntry | ChainProblem | None:
        """The user's entry ``seq``, as shown (looked up by its seq: the trail is not read
        from its start); a row with that seq that reads as no entry is its problem, which
        names the row, as an export marks it."""
        found = await self.stores.audit.entry_row(user_id, seq)
        return found if found is None or isinstance(found, ChainProblem) else self.shown(found)

    async def verify(self, user_id: str | Any | None = ANY_USER) -> VerifyReport:
        return await self.stores.audit.verify(user_id=user_id)

    @staticmethod
    def export_header(user_id: str | None, where: TrailFilter, after_seq: int = 0) -> str:
        """The first line of an export of this user's trail (as ``loomflow audit export
        --user`` writes it): it names the filters, which ``verify --file`` holds the lines
        to (``verify --file ... --user`` checks the export as this user's alone).
        ``after_seq``: one page of the trail, whose entries come after that one; named, or a
        verifier would take the page for a whole trail missing its first entries."""
        header = AuditFilter.build(user_id=user_id, **where.as_kwargs()).export_header(after_seq)
        assert header is not None  # a user is always a filter
        return header + "\n"

    async def export_lines(self, user_id: str | None, where: TrailFilter) -> AsyncIterator[str]:
        """The selected entries as the lines of ``loomflow audit export`` (as stored,
        unredacted: the admin export), one page at a time, after the export's header; a row
        that reads as no entry is marked in its place, as that export marks it."""
        lines: list[str] = [self.export_header(user_id, where)]
        async for row in self.stores.audit.rows(user_id=user_id, **where.as_kwargs()):
            lines.append(export_line(row) + "\n")
            if len(lines) == _EXPORT_CHUNK:
                yield "".join(lines)
                lines = []
        if lines:
            yield "".join(lines)

    async def run(self, user_id: str | None, run_id: str) -> RunStory:
        """The story of one of the user's runs; its entries as shown (see :meth:`shown`).

        A row that reads as no entry is kept in its place (:attr:`RunStory.rows`), as an
        export marks it, and the rest of the run is told; the user's trail is then verified,
        so that the story says the trail fails verification (:attr:`RunStory.report`).
        """
        rows: list[AuditEntry | ChainProblem] = []
        truncated = False
        async for row in self.stores.audit.rows(user_id=user_id, run_id=run_id):
            if len(rows) == _STORY_LIMIT:
                truncated = True
                break
            rows.append(row)
        entries = [row for row in rows if isinstance(row, AuditEntry)]
        shown = [row if isinstance(row, ChainProblem) else self.shown(row) for row in rows]
        story = RunStory(
            user_id,
            run_id,
            [row for row in shown if isinstance(row, AuditEntry)],
            truncated,
            None,
            None,
            rows=shown,
        )
        if story.unreadable:
            story.report = await self.verify(user_id)
        runtime = self.stores.runtime
        session_id = story.session_id
        # Without a session the run has no row in the journal to find: asking for the user's
        # sessions with no session id would answer with their latest one, another run's state.
        if runtime is not None and entries and session_id is not None:
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

    async def runs(
        self, state: str | None, limit: int = 500
    ) -> tuple[list[tuple[SessionInfo, str]], bool]:
        """The journal's ``limit`` most recent runs, with their state (``state`` keeps one);
        and whether there were more."""
        runtime = self.stores.runtime
        if runtime is None:
            return [], False
        try:
            # One more than shown: a page cut at the limit says so, rather than passing for
            # every run in that state.
            sessions = await runtime.sessions(limit=limit + 1, state=state)
        except LoomflowError as exc:
            raise JournalError(
                "the journal cannot be read here: the console never creates or migrates it "
                f"(run `loomflow migrate` if this database should hold one) ({exc})"
            ) from exc
        listed = [(info, info.state) for info in sessions[:limit]]
        return [(i, s) for i, s in listed if state is None or s == state], len(sessions) > limit
