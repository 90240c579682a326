"""The audit store seam: one abstract class, sibling backends (memory, JSONL, SQLite, PostgreSQL).

Backends only append a user's records under a per-user lock, fetch filtered pages and walk the
chains; grouping, pagination, export and verification are written once here.
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import dataclasses
import datetime as dt
import io
import json
import os
import shlex
import stat
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from .._files import open_private
from .._ids import check_id, check_key, user_label
from .._progress import OnProgress, Progress
from ..errors import (
    AuditError,
    AuditIntegrityError,
    InvalidArgumentError,
    InvalidIdError,
    LegalHoldError,
    UserError,
)
from ._entry import (
    DIGESTED_VERSION,
    ENTRY_SCHEMA_VERSION,
    GENESIS,
    MAX_EXACT_INT,
    UNREADABLE,
    AuditEntry,
    AuditRecord,
    iso_time,
    json_line,
    time_us_of,
    time_us_of_text,
    user_key,
)
from .actions import (
    AUDIT_ERASURE,
    KEPT_BY_ERASURE,
    LEGAL_HOLD_PLACED,
    LEGAL_HOLD_RELEASED,
    refuse_reserved,
)

__all__ = [
    "ANY_USER",
    "EXPORT_FILTERS",
    "EXPORT_FORMAT",
    "EXPORT_HEADER",
    "AuditFilter",
    "AuditPage",
    "AuditStore",
    "ChainHead",
    "ChainProblem",
    "ErasureResult",
    "LegalHold",
    "RetentionReport",
    "VerifyReport",
    "damaged_row",
    "export_line",
]


class _AnyUser:
    def __repr__(self) -> str:
        return "ANY_USER"


_PAGE = 1000  # entries per page when reading everything (export, count, verify's reports)
MAX_PAGE = 10_000  # the largest page a query returns

ANY_USER: Any = _AnyUser()
"""Default of ``user_id`` filters: every user (``None`` means the anonymous bucket)."""

EXPORT_HEADER = "loomflow_audit_export"
"""The key of the line an export made with filters starts with; its value is the format
(``EXPORT_FORMAT``), beside ``filters``. An export of the whole log has no such line."""
EXPORT_FORMAT = 1
EXPORT_FILTERS = ("user_id", "session_id", "run_id", "action", "since", "until", "after_seq")
"""The filters an export header may name (``user_id`` may be ``null``: the anonymous bucket;
``after_seq``, digits: a page of a trail that starts past that entry, as the console exports it)."""

ProblemKind = Literal[
    "edited",
    "broken_link",
    "missing",
    "duplicate",
    "reordered",
    "truncated",
    "head_mismatch",
    "unanchored",
    "unreadable",
    "erased",
    "outside_export",
    "unscoped",
]


@dataclass(frozen=True, slots=True)
class AuditFilter:
    """Which entries a query selects (every field ``None`` selects everything)."""

    user_key: str | None = None
    session_id: str | None = None
    run_id: str | None = None
    action: str | None = None
    action_prefix: str | None = None
    since_us: int | None = None
    until_us: int | None = None
    seq: int | None = None  # one entry of a user's trail (AuditStore.entry); never exported

    @classmethod
    def build(
        cls,
        *,
        user_id: str | None = ANY_USER,
        session_id: str | None = None,
        run_id: str | None = None,
        action: str | None = None,
        since: dt.datetime | float | None = None,
        until: dt.datetime | float | None = None,
    ) -> AuditFilter:
        """From the public keyword arguments; ``action="tool.*"`` selects a family."""
        # The same id rule as every other store: a lone surrogate or a NUL must be a typed
        # error here too, not a driver's encoding error.
        if user_id is not ANY_USER:
            check_id("user_id", user_id)
        check_id("session_id", session_id)
        check_id("run_id", run_id)
        check_key("action", action)
        prefix = None
        if action is not None and action.endswith("*"):
            prefix, action = action[:-1], None
        return cls(
            user_key=None if user_id is ANY_USER else user_key(user_id),
            session_id=session_id,
            run_id=run_id,
            action=action,
            action_prefix=prefix,
            since_us=None if since is None else time_us_of(since),
            until_us=None if until is None else time_us_of(until),
        )

    def described(self) -> dict[str, Any]:
        """The filters that are set, as an export header names them (times in the exported
        spelling, a family of actions as ``tool.*``)."""
        named: dict[str, Any] = {}
        if self.user_key is not None:
            named["user_id"] = json.loads(self.user_key)
        if self.session_id is not None:
            named["session_id"] = self.session_id
        if self.run_id is not None:
            named["run_id"] = self.run_id
        if self.action is not None:
            named["action"] = self.action
        elif self.action_prefix is not None:
            named["action"] = self.action_prefix + "*"
        if self.since_us is not None:
            named["since"] = iso_time(self.since_us)
        if self.until_us is not None:
            named["until"] = iso_time(self.until_us)
        return named

    def export_header(self, after_seq: int = 0) -> str | None:
        """The first line of an export made with these filters (``None``: no filter, so the
        export is the whole log and has no header). It tells a reader what the export was
        made with; no hash covers it, so a verifier checks it against the lines and never lets
        it narrow the check (which users to look for is the ``--user`` of whoever verifies).
        ``after_seq``: the export is one page of a trail, past that entry (the console's)."""
        named = self.described()
        if after_seq > 0:
            named["after_seq"] = str(after_seq)
        if not named:
            return None
        header = {EXPORT_HEADER: EXPORT_FORMAT, "filters": named}
        return json_line(header)

    def matches(self, entry: AuditEntry) -> bool:
        """Whether ``entry`` passes (for backends that filter in Python)."""
        return (
            (self.user_key is None or user_key(entry.user_id) == self.user_key)
            and (self.session_id is None or entry.session_id == self.session_id)
            and (self.run_id is None or entry.run_id == self.run_id)
            and (self.action is None or entry.action == self.action)
            and (self.action_prefix is None or entry.action.startswith(self.action_prefix))
            and (self.since_us is None or entry.time_us >= self.since_us)
            and (self.until_us is None or entry.time_us < self.until_us)
            and (self.seq is None or entry.seq == self.seq)
        )


@dataclass(frozen=True, slots=True)
class AuditPage:
    """One page of a query; pass ``next_cursor`` back to get the next (``None``: no more).

    ``damaged``: the rows of this page that could not be read as entries at all (a ``seq``
    or time edited into something that is no number, bytes in a text column), each as the
    ``unreadable`` problem ``verify`` reports for it (its user and seq as far as they can be
    read, its row id as ``position``). They are not in ``entries``, so a page holding one is
    not the whole answer; an entry whose payload alone is damaged is in ``entries``, marked
    (:attr:`AuditEntry.unreadable`). ``rows``: both, in storage order, as :meth:`AuditStore.query`
    read them (empty on a page built otherwise).
    """

    entries: list[AuditEntry]
    next_cursor: str | None
    damaged: list[ChainProblem] = field(default_factory=list)
    rows: list[AuditEntry | ChainProblem] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ChainHead:
    """The last entry of a user's chain as the store recorded it when it wrote that entry."""

    user_id: str | None
    seq: int
    hash: str


@dataclass(frozen=True, slots=True)
class ChainProblem:
    """One thing ``verify`` found wrong, and where.

    Attributes:
        user_id: Whose chain.
        kind: ``edited`` (content does not match its hash), ``broken_link`` (an entry does
            not link to the one before it: that one was replaced), ``missing`` (entries
            deleted from the middle), ``duplicate``, ``reordered`` (stored out of order),
            ``truncated`` (entries missing at the end), ``head_mismatch``, ``unanchored``
            (entries past the recorded head), ``unreadable`` (a row or line cannot be parsed),
            ``erased`` (a payload is gone and no erasure record after it covers it); for
            exports only, ``outside_export`` (a line of another user than the one checked,
            or outside the filters the export's header names) and the warning ``unscoped``
            (the header names one user, but the export was checked as the whole log).
        seq: The entry (or first missing entry) concerned.
        position: Where it is stored: a row id, or a line number for JSONL files.
        detail: A sentence for people.
    """

    user_id: str | None
    kind: ProblemKind
    seq: int | None
    position: int | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {
            "user_id": self.user_id,
            "kind": self.kind,
            "seq": self.seq,
            "position": self.position,
            "detail": self.detail,
        }


@dataclass(slots=True)
class VerifyReport:
    """What ``verify`` checked and found. ``ok`` is true when ``problems`` is empty.

    ``erased`` counts entries whose payload was erased under an erasure record (their place
    in the chain still checks out; their payload is gone).
    """

    users: int = 0
    entries: int = 0
    erased: int = 0
    problems: list[ChainProblem] = field(default_factory=list)
    warnings: list[ChainProblem] = field(default_factory=list)
    heads: list[ChainHead] = field(default_factory=list)
    export_filters: dict[str, Any] | None = None
    """For an export that says it was made with filters (its header line), those filters, as
    the exporter wrote them: no hash covers them, so they were checked against the lines
    (``outside_export``) but decided nothing about which users were looked for. ``None``
    otherwise."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        data = {
            "ok": self.ok,
            "users": self.users,
            "entries": self.entries,
            "erased": self.erased,
            "problems": [p.to_json() for p in self.problems],
            "warnings": [w.to_json() for w in self.warnings],
            "heads": [{"user_id": h.user_id, "seq": h.seq, "hash": h.hash} for h in self.heads],
        }
        if self.export_filters is not None:
            data["export_filters"] = self.export_filters
        return data


@dataclass(frozen=True, slots=True)
class ErasureResult:
    """What :meth:`AuditStore.erase` did to one user's trail.

    Attributes:
        user_id: The user.
        record_seq: ``seq`` of the ``audit.erasure`` entry written (``None``: nothing to
            erase, so nothing was written).
        erased: How many payloads were erased.
    """

    user_id: str | None
    record_seq: int | None
    erased: int


@dataclass(frozen=True, slots=True)
class LegalHold:
    """A user's legal hold: who placed it, when and why (the ``legal_hold.placed`` entry)."""

    user_id: str | None
    reason: str
    actor: str
    placed_at: dt.datetime
    seq: int

    def to_json(self) -> dict[str, Any]:
        return {
            "user_id": self.user_id,
            "reason": self.reason,
            "actor": self.actor,
            "placed_at": iso_time(time_us_of(self.placed_at)),
            "seq": self.seq,
        }


@dataclass(slots=True)
class RetentionReport:
    """What :meth:`AuditStore.retain` did (or, with ``dry_run``, would do).

    Attributes:
        cutoff: Payloads of entries written before this time were erased.
        erased: Payloads erased per user (would be, with ``dry_run``).
        held: Users with payloads past the cut-off left alone: they are under legal hold.
        refused: Users left alone because ``verify`` finds their trail damaged (an entry
            edited, forged, deleted, reordered or unreadable, a payload erased on no record):
            it is evidence, and nothing of it is erased. Each with the damage, by kind.
    """

    cutoff: dt.datetime
    erased: dict[str | None, int] = field(default_factory=dict)
    held: list[str | None] = field(default_factory=list)
    refused: dict[str | None, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "cutoff": iso_time(time_us_of(self.cutoff)),
            "erased": [{"user_id": u, "entries": n} for u, n in self.erased.items()],
            "held": self.held,
            "refused": [{"user_id": u, "problem": p} for u, p in self.refused.items()],
        }


ChainItem = tuple[str, int, AuditEntry | ChainProblem]
"""``(user_key, position, entry)`` in user-then-seq order, or a problem found while reading."""


class AuditStore(abc.ABC):
    """Where audit entries live. Subclasses implement the ``_``-methods."""

    backend: str
    #: Whether a head that lags the chain is tampering (every backend here: SQL writes head
    #: and entry in one transaction, JSONL tells a crashed append by its recorded intent).
    #: A backend that cannot tell sets it false, and entries past the head are warnings.
    head_written_atomically: bool = True

    async def open(self) -> None:  # noqa: B027 - most backends have nothing to open
        """Connect and create or migrate the schema (idempotent; called on first use)."""

    async def close(self) -> None:  # noqa: B027 - nor anything to close
        """Release connections and files this store opened."""

    async def __aenter__(self) -> AuditStore:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- writing ----------------------------------------------------------------------------

    async def append(self, records: AuditRecord | Iterable[AuditRecord]) -> list[AuditEntry]:
        """Seal and store records; each user's chain grows by one entry per record, in order.

        Records of one user are written atomically, under a lock that serialises that user's
        writers in every process; returns the stored entries.

        Raises:
            ReservedActionError: a record's action is one loomflow keeps for its own entries
                (``audit.*``, ``legal_hold.*``, ``console.*`` or one that reads like them) or
                its user id names a console chain; nothing of the batch is written. Holds,
                erasures and deletions are written by :meth:`place_hold`,
                :meth:`release_hold`, :meth:`erase` and the ``Stores`` methods.
        """
        batch = _batch(records)
        for record in batch:
            refuse_reserved(record.action, record.user_id)
        return await self._write(batch)

    async def _write(self, records: AuditRecord | Iterable[AuditRecord]) -> list[AuditEntry]:
        """:meth:`append` without the reserved-action check: loomflow's own writers only."""
        ordered: list[AuditRecord] = []
        groups: dict[str, list[AuditRecord]] = {}
        for record in _batch(records):
            checked = record.checked()
            ordered.append(checked)
            groups.setdefault(user_key(checked.user_id), []).append(checked)
        if not groups:
            return []
        await self.open()
        sealed: dict[int, AuditEntry] = {}
        for key, group in groups.items():
            for record, entry in zip(group, await self._append_chain(key, group), strict=True):
                sealed[id(record)] = entry
        return [sealed[id(r)] for r in ordered]

    @abc.abstractmethod
    async def _append_chain(self, key: str, records: Sequence[AuditRecord]) -> list[AuditEntry]:
        """Append one user's records after that user's head, atomically and serialised."""

    # -- reading ----------------------------------------------------------------------------

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
        """One page of entries in write order.

        Args:
            user_id: Only this user's entries (``None`` is the anonymous bucket); all users
                when left out.
            session_id: Only this session.
            run_id: Only this run.
            action: Only this action, or a family such as ``"tool.*"``.
            since: Entries written at or after this time (datetime or Unix seconds).
            until: Entries written before this time.
            limit: Page size (1 to 10 000).
            cursor: ``next_cursor`` of the previous page.
        """
        if not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
            raise UserError(f"limit must be an integer from 1 to {MAX_PAGE}, not {limit!r}")
        after = _parse_cursor(cursor)
        where = AuditFilter.build(
            user_id=user_id,
            session_id=session_id,
            run_id=run_id,
            action=action,
            since=since,
            until=until,
        )
        await self.open()
        rows, last = await self._query(where, limit, after)
        more = len(rows) == limit and last is not None
        entries = [row for row in rows if isinstance(row, AuditEntry)]
        damaged = [row for row in rows if isinstance(row, ChainProblem)]
        return AuditPage(entries, str(last) if more else None, damaged, list(rows))

    async def entry(self, user_id: str | None, seq: int) -> AuditEntry | None:
        """The entry ``seq`` of the user's trail (``None``: no entry has it), looked up by
        its seq rather than found by reading the trail from its start: the last entry of a
        long trail is as quick as the first, and rows before it are not read.

        A trail whose rows were edited may hold more than one row with that seq (a store
        without a unique key): the first stored is returned.
        """
        found = await self.entry_row(user_id, seq)
        if isinstance(found, ChainProblem):  # a row that reads as no entry
            raise AuditIntegrityError(found.detail)
        return found

    async def entry_row(self, user_id: str | None, seq: int) -> AuditEntry | ChainProblem | None:
        """As :meth:`entry`, but a row stored with that seq that reads as no entry is
        returned as its ``unreadable`` problem (see :attr:`AuditPage.damaged`), for a caller
        that shows it marked rather than failing."""
        if type(seq) is not int or seq < 1:
            raise UserError(f"seq must be a whole number from 1, not {seq!r}")
        where = AuditFilter.build(user_id=user_id)
        if seq > _MAX_SEQ:  # no entry has it, and a database would refuse the number
            return None
        await self.open()
        found, _ = await self._query(dataclasses.replace(where, seq=seq), 1, None)
        return found[0] if found else None

    @abc.abstractmethod
    async def _query(
        self, where: AuditFilter, limit: int, after: int | None
    ) -> tuple[Sequence[AuditEntry | ChainProblem], int | None]:
        """Up to ``limit`` matching rows stored after position ``after``, and the last
        position returned: each an entry, or the ``unreadable`` problem of a row that reads
        as no entry (a backend whose rows are typed in storage never has one)."""

    async def count(self, **filters: Any) -> int:
        """How many entries the filters of :meth:`query` select (over all its pages).

        Example:
            >>> await store.count(user_id="alice", action="tool.*", since=yesterday)
            42
        """
        where = AuditFilter.build(**filters)
        await self.open()
        return await self._count(where)

    async def _count(self, where: AuditFilter) -> int:
        """Count matching entries; this default pages through :meth:`_query`."""
        count, after = 0, None
        while True:
            entries, last = await self._query(where, _PAGE, after)
            count += len(entries)
            if len(entries) < _PAGE or last is None:
                return count
            after = last

    async def _pages(self, **filters: Any) -> AsyncIterator[list[AuditEntry | ChainProblem]]:
        """Every matching row, a page at a time, in storage order (damaged rows in place)."""
        where = AuditFilter.build(**filters)
        await self.open()
        after: int | None = None
        while True:
            rows, last = await self._query(where, _PAGE, after)
            yield list(rows)
            if len(rows) < _PAGE or last is None:
                return
            after = last

    async def entries(self, **filters: Any) -> AsyncIterator[AuditEntry]:
        """Every matching entry, page by page (the filters of :meth:`query`).

        Raises:
            AuditIntegrityError: a row reads as no entry; :meth:`rows` yields it in its
                place instead, and the entries after it.
        """
        async for row in self.rows(**filters):
            if isinstance(row, ChainProblem):
                raise AuditIntegrityError(row.detail)
            yield row

    async def rows(self, **filters: Any) -> AsyncIterator[AuditEntry | ChainProblem]:
        """Every matching row in storage order (the filters of :meth:`query`): an entry, or
        for a row that reads as no entry, the ``unreadable`` problem that says which row and
        what is wrong (see :attr:`AuditPage.damaged`). For exports that must go on past a
        damaged row and say where it was."""
        async for page in self._pages(**filters):
            for row in page:
                yield row

    def _own_files(self) -> tuple[Path, ...]:
        """The files this store keeps the log in (none for a database or memory)."""
        return ()

    def _refuse_own_file(self, dest: Path) -> None:
        """An export written over the log's own file would truncate it before reading it: the
        trail lost, and an empty export reported as a success."""
        for own in self._own_files():
            if dest.exists() and own.exists() and os.path.samefile(dest, own):
                raise InvalidArgumentError(
                    f"{str(dest)!r} is a file of the audit log itself, which an export would "
                    "overwrite: name a new file"
                )

    async def export(
        self,
        dest: str | os.PathLike[str] | TextIO,
        *,
        on_progress: OnProgress | None = None,
        on_damaged: Callable[[ChainProblem], None] | None = None,
        **filters: Any,
    ) -> int:
        """Write matching entries as JSON lines to a path or text stream; returns the count.

        The lines are the entries' exported form, so ``loomflow.audit.verify_lines`` (or
        any SHA-256 implementation) can re-check them offline. With filters, the first line
        is a header naming them (``{"filters": {"user_id": "alice"},
        "loomflow_audit_export": 1}``), so that a verifier checks the users the export was
        made for against saved heads, and no others; without, the export is the whole log and
        has no header. ``filters`` are those of :meth:`query`. With
        ``on_progress(done, total)``, the entries are counted first (:meth:`count`) and the
        callback hears after every page of 1000. The count returned is of entries.

        A damaged row does not stop the export: a row that reads as no entry is written in its
        place as a marker line (:func:`damaged_row`: ``"unreadable"``, ``"row"``,
        ``"user_id"``, ``"seq"``, and no hash), which ``verify_lines`` and the Node verifier
        report as ``unreadable``; an entry whose payload alone is damaged is written with its
        ``"unreadable"`` key. ``on_damaged(problem)`` hears of each such row (kind
        ``unreadable``, position its row id when known), so that the caller can tell an
        export that holds one from a complete one.
        """
        where = AuditFilter.build(**filters)  # bad filters fail before the file is created
        if isinstance(dest, str | os.PathLike):
            self._refuse_own_file(Path(dest))
            # Local file writes in 1 MiB chunks: not worth a thread hop per chunk.
            fh = open_private(Path(dest))  # owner-only: users' data
            regular = stat.S_ISREG(os.fstat(fh.fileno()).st_mode)  # not a pipe or a device
            try:
                with fh:
                    return await self.export(
                        fh, on_progress=on_progress, on_damaged=on_damaged, **filters
                    )
            except BaseException:
                if regular:
                    # A file cut short (a malformed row, a cancelled export) would pass for a
                    # smaller export.
                    _remove(Path(dest))
                raise
        progress = Progress(
            on_progress, await self.count(**filters) if on_progress is not None else None
        )
        buffer = io.StringIO()
        header = where.export_header()
        if header is not None:
            buffer.write(header + "\n")
        written = 0
        async for page in self._pages(**filters):
            for row in page:
                buffer.write(export_line(row))
                if isinstance(row, AuditEntry):
                    written += 1
                    if row.unreadable is not None:
                        row = ChainProblem(row.user_id, "unreadable", row.seq, None, row.unreadable)
                if on_damaged is not None and isinstance(row, ChainProblem):
                    on_damaged(row)
                buffer.write("\n")
            progress.advance(len(page))
            if buffer.tell() > 1 << 20:
                dest.write(buffer.getvalue())
                buffer = io.StringIO()
        dest.write(buffer.getvalue())
        dest.flush()
        progress.finish()
        return written

    async def head(self, user_id: str | None) -> ChainHead | None:
        """The recorded head of a user's chain, or ``None`` if the user has no entries."""
        check_id("user_id", user_id)
        await self.open()
        key = user_key(user_id)
        found = (await self._heads(key)).get(key)
        return None if found is None else _keyed(key, found)[0]

    async def heads(self) -> list[ChainHead]:
        """The recorded head of every user's chain: who the log knows, with entry counts.

        Each names the user whose trail key it is recorded under, which is what that trail's
        entries are stored and queried by: no hash covers a head's user column, and one
        edited to another name would list that user in place of the trail's own (``verify``
        reports such a head as ``head_mismatch``).
        """
        await self.open()
        return [_keyed(key, head)[0] for key, head in sorted((await self._heads(None)).items())]

    async def iter_heads(self, *, page_size: int = 1000) -> AsyncIterator[ChainHead]:
        """The heads of :meth:`heads`, read ``page_size`` at a time: a console listing the
        first users of a log that knows 300,000 reads a page, not every head at once.

        Heads come in the backend's order of their trail keys (not always :meth:`heads`'
        order), each once; a trail that gains its first entry during the walk may be missed.
        """
        async for head in self.iter_head_rows(page_size=page_size):
            if isinstance(head, ChainProblem):
                whose = "" if head.kind == "unreadable" else f" (of {user_label(head.user_id)})"
                raise AuditIntegrityError(head.detail + whose)
            yield head

    async def iter_head_rows(
        self, *, page_size: int = 1000
    ) -> AsyncIterator[ChainHead | ChainProblem]:
        """The heads of :meth:`iter_heads`, and in its place each head row that reads as no
        head (edited by hand): one such row must not hide every other user of the log.

        A malformed head of a known trail (a seq that is no whole number, a user column that
        is no text) is the ``head_mismatch`` problem ``verify`` reports for it, filed under
        the trail's user; a head row whose key names no trail at all is an ``unreadable``
        problem with no user.
        """
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, not {page_size}")
        await self.open()
        async for page in self._head_pages(page_size):
            for key, head in page:
                yield head if isinstance(head, ChainProblem) else _keyed(key, head)[0]

    # -- erasure, retention and legal hold ---------------------------------------------------

    async def erase(
        self,
        user_id: str | None,
        *,
        reason: str,
        actor: str = "loomflow",
        before: dt.datetime | float | None = None,
        deleted: dict[str, int] | None = None,
        always_record: bool = True,
    ) -> ErasureResult:
        """Erase the payloads of a user's entries (all, or those written before ``before``).

        First an ``audit.erasure`` entry is appended to the user's trail, recording the
        reason, the cut-off, how many payloads go, ``deleted`` (counts from other stores) and,
        for entries of hash versions 1 and 2, the digest of everything but the payload; then
        the payloads of the entries before it are erased. The chain keeps verifying: version 3
        hashes cover a salted digest of the payload, and ``verify`` accepts an erased payload
        only when an erasure record after it covers it. Entries written after the record, and the
        records of erasures and legal holds, keep their payloads. Running it again finishes
        what a crash interrupted.

        Raises:
            LegalHoldError: the user is under legal hold.
            ErasureRefusedError: the database role may not erase (the application role).
        """
        check_id("user_id", user_id)
        _check_text("reason", reason)
        _check_text("actor", actor)
        await self.check_not_held(user_id)
        await self.check_can_erase()
        before_us = None if before is None else time_us_of(before)
        count, old, changed = 0, {}, []
        async for entry in self.entries(user_id=user_id, until=before):
            if entry.payload is None:
                continue
            # A hold or erasure record keeps its payload but decides what may go: one edited
            # in the database (a placement turned into a release) refuses erasure too.
            if erasure_problem(entry) is not None:
                changed.append(entry.seq)
            if entry.action in KEPT_BY_ERASURE:
                continue
            count += 1
            if entry.hash_version < DIGESTED_VERSION:
                old[str(entry.seq)] = entry.rest_digest()
        _refuse_changed(user_id, changed)
        _refuse_uncovered(user_id, await self._uncovered_erasures(user_id))
        if not count and not always_record:
            return ErasureResult(user_id, None, 0)
        payload: dict[str, Any] = {
            "reason": reason,
            "before": None if before_us is None else iso_time(before_us),
            "entries": count,
            "pre_v3": old,
        }
        if deleted is not None:
            payload["deleted"] = dict(deleted)
        seq = await self._record_erasure(user_id, actor, payload)
        erased = await self._tombstone(
            user_key(user_id), seq, before_us, sorted(int(s) for s in old)
        )
        return ErasureResult(user_id, seq, erased)

    async def check_erasable(self, user_id: str | None) -> None:
        """Raise :class:`~loomflow.errors.AuditIntegrityError` if erasing the payloads of the
        user's entries would hide that one of them was changed (see :func:`erasure_problem`),
        or if a hold or erasure record, which decides what may be erased, was changed, or if
        ``verify`` finds the trail damaged in any other way (as retention leaves such a trail
        alone); a forget calls it before deleting anything anywhere."""
        changed = [
            entry.seq
            async for entry in self.entries(user_id=user_id)
            if entry.payload is not None and erasure_problem(entry) is not None
        ]
        _refuse_changed(user_id, changed)
        _refuse_uncovered(user_id, await self._uncovered_erasures(user_id))
        # A hold is looked up in the trail: one deleted from it, or moved under another trail
        # key, goes unseen, so a trail with entries gone (or any damage) is evidence to keep.
        if damage := (await self.verify(user_id=user_id)).problems:
            raise AuditIntegrityError(_damaged(user_id, damage))

    async def _uncovered_erasures(self, user_id: str | None) -> list[int]:
        """The seqs of the user's erased payloads that no erasure record covers (what
        ``verify`` reports as ``erased``): removed in the database, behind every record's
        back. A new record would cover them, and the trail would verify again."""
        checker = _ChainCheck(user_key(user_id), user_id)
        found = VerifyReport()
        async for entry in self.entries(user_id=user_id):
            if entry.payload is None:
                checker._content(entry, entry.seq, found)  # notes it, as verify does
            elif (
                entry.action == AUDIT_ERASURE
                and isinstance(entry.payload, dict)
                and erasure_problem(entry) is None  # an edited record vouches for nothing
            ):
                checker.records.append(
                    _ErasureRecord.of(entry.seq, entry.payload, held=checker.held)
                )
            if entry.action in _HOLD_ACTIONS:
                checker.held = entry.action == LEGAL_HOLD_PLACED
        checker.finish_erasures(found)
        return sorted({p.seq for p in found.problems if p.seq is not None})

    async def _record_erasure(self, user_id: str | None, actor: str, payload: Any) -> int:
        """Append the ``audit.erasure`` record that vouches for what follows; its seq.

        A hold placed between the caller's check and the record comes before the record in
        the user's (serialised) trail: it still wins, and nothing is erased.
        """
        [record] = await self._write(
            AuditRecord(user_id=user_id, actor=actor, action=AUDIT_ERASURE, payload=payload)
        )
        hold = _hold_of(await self._last_hold_entry(user_id, before_seq=record.seq))
        if hold is not None:
            raise _held(hold)
        return record.seq

    async def erase_entries(
        self,
        user_id: str | None,
        seqs: Iterable[int],
        *,
        reason: str,
        actor: str = "loomflow",
    ) -> ErasureResult:
        """Erase the payloads of the chosen entries of one user's chain, and no others.

        For a chain whose entries name someone else: after a forget, the console's chains
        (``console:<name>``) lose the payloads of the looks at the forgotten user, while the
        rest of who looked at what stays. As with :meth:`erase`, an ``audit.erasure`` entry
        (the reason, the ``seqs`` erased, their count, ``pre_v3`` digests) is appended first,
        so the chain keeps verifying. Seqs already erased, missing, or of erasure and hold
        records are skipped; with none left nothing is written (``record_seq`` is ``None``).

        Raises:
            LegalHoldError: the chain's user is under legal hold.
            ErasureRefusedError: the database role may not erase (the application role).
        """
        check_id("user_id", user_id)
        _check_text("reason", reason)
        _check_text("actor", actor)
        await self.check_not_held(user_id)
        await self.check_can_erase()
        wanted = {int(s) for s in seqs}
        chosen: list[int] = []
        changed: list[int] = []
        old: dict[str, str] = {}
        if wanted:
            async for entry in self.entries(user_id=user_id):
                if entry.seq not in wanted or entry.payload is None:
                    continue
                if entry.action in KEPT_BY_ERASURE:
                    continue
                chosen.append(entry.seq)
                if erasure_problem(entry) is not None:
                    changed.append(entry.seq)
                if entry.hash_version < DIGESTED_VERSION:
                    old[str(entry.seq)] = entry.rest_digest()
        _refuse_changed(user_id, changed)
        if not chosen:
            return ErasureResult(user_id, None, 0)
        payload = {
            "reason": reason,
            "before": None,
            "entries": len(chosen),
            "seqs": chosen,
            "pre_v3": old,
        }
        seq = await self._record_erasure(user_id, actor, payload)
        erased = await self._tombstone(user_key(user_id), seq, None, chosen, sweep=False)
        return ErasureResult(user_id, seq, erased)

    async def _tombstone(
        self,
        key: str,
        below_seq: int,
        before_us: int | None,
        old_seqs: Sequence[int],
        *,
        sweep: bool = True,
    ) -> int:
        """Erase the payloads (and salts) of one user's entries before ``below_seq``.

        Version 3 entries (written before ``before_us`` if given; none with ``sweep=False``)
        and the entries at ``old_seqs``, whatever their version; never the actions of
        ``KEPT_BY_ERASURE``, never one already erased. Returns how many were erased; atomic
        per call.
        """
        raise AuditError(f"{type(self).__name__} cannot erase payloads")

    async def check_can_erase(self) -> None:  # noqa: B027 - only PostgreSQL has roles to check
        """Raise :class:`~loomflow.errors.ErasureRefusedError` if this store's connection may
        not erase payloads (checked before anything is deleted anywhere)."""

    async def check_appendable(self, user_id: str | None) -> None:  # noqa: B027 - JSONL only
        """Raise :class:`~loomflow.errors.AuditIntegrityError` if this store refuses appends to
        the user's trail (a JSON-lines log refuses them for a trail it found damaged), so that
        a forget, whose erasure record is such an append, stops before deleting anything."""

    async def check_not_held(self, user_id: str | None) -> None:
        """Raise :class:`~loomflow.errors.LegalHoldError` (naming the hold) if the user is held."""
        await self.open()
        hold = await self.legal_hold(user_id)
        if hold is not None:
            raise _held(hold)

    async def legal_hold(self, user_id: str | None) -> LegalHold | None:
        """The user's legal hold, or ``None`` if they are not held."""
        check_id("user_id", user_id)
        return _hold_of(await self._last_hold_entry(user_id))

    async def _last_hold_entry(
        self, user_id: str | None, *, before_seq: int | None = None
    ) -> AuditEntry | None:
        last: AuditEntry | None = None
        async for entry in self.entries(user_id=user_id, action="legal_hold.*"):
            # Only a placement or a release moves a hold: any other entry under the prefix
            # (a note an app wrote by hand, say) leaves the hold as it was.
            if entry.action in _HOLD_ACTIONS and (before_seq is None or entry.seq < before_seq):
                last = entry
        return last

    async def legal_holds(self) -> list[LegalHold]:
        """Every user under legal hold, in the order the holds were placed."""
        last: dict[str, AuditEntry] = {}
        async for entry in self.entries(action="legal_hold.*"):
            if entry.action in _HOLD_ACTIONS:
                last[user_key(entry.user_id)] = entry
        holds = [h for e in last.values() if (h := _hold_of(e)) is not None]
        return sorted(holds, key=lambda h: h.placed_at)

    async def place_hold(
        self, user_id: str | None, *, reason: str, actor: str = "loomflow"
    ) -> LegalHold:
        """Put a user under legal hold: forget and retention refuse to erase their data.

        The hold is a ``legal_hold.placed`` entry in the user's own trail, so it is as
        durable as the trail and audited by being there.

        Raises:
            LegalHoldError: the user is already held (release first to change the reason).
            UserError: an empty reason.
        """
        check_id("user_id", user_id)
        _check_text("reason", reason)
        _check_text("actor", actor)
        held = await self.legal_hold(user_id)
        if held is not None:
            raise _held(held, "already ")
        [entry] = await self._write(
            AuditRecord(
                user_id=user_id, actor=actor, action=LEGAL_HOLD_PLACED, payload={"reason": reason}
            )
        )
        hold = _hold_of(entry)
        assert hold is not None
        return hold

    async def release_hold(
        self, user_id: str | None, *, actor: str = "loomflow", reason: str = ""
    ) -> LegalHold:
        """Release a user's legal hold; returns the hold released.

        Raises:
            UserError: the user is not under legal hold.
        """
        check_id("user_id", user_id)
        _check_text("actor", actor)
        held = await self.legal_hold(user_id)
        if held is None:
            raise UserError(f"{user_label(user_id)} is not under legal hold")
        await self._write(
            AuditRecord(
                user_id=user_id,
                actor=actor,
                action=LEGAL_HOLD_RELEASED,
                payload={"reason": reason, "placed_seq": held.seq},
            )
        )
        return held

    async def retain(
        self,
        older_than: dt.timedelta,
        *,
        actor: str = "loomflow",
        dry_run: bool = False,
    ) -> RetentionReport:
        """Erase the payloads of entries older than ``older_than``, but not of held users.

        Each user with such payloads gets one ``audit.erasure`` entry (reason ``retention``)
        and loses the payloads written before the cut-off (see :meth:`erase`). A user whose
        trail ``verify`` finds damaged is left alone and listed under ``refused`` (with
        ``dry_run`` too); the others are still erased.

        Raises:
            UserError: ``older_than`` is not a positive timedelta, or reaches before year 1
                (:class:`~loomflow.errors.InvalidArgumentError`).
            ErasureRefusedError: the database role may not erase.
        """
        if not isinstance(older_than, dt.timedelta) or older_than <= dt.timedelta(0):
            raise UserError(f"older_than must be a positive timedelta, not {older_than!r}")
        try:
            cutoff = dt.datetime.now(dt.UTC) - older_than
        except OverflowError:  # timedelta(days=999_999): before year 1
            raise InvalidArgumentError(
                f"older_than {older_than!r} is out of range: it reaches back before year 1"
            ) from None
        await self.open()
        if not dry_run:
            await self.check_can_erase()
        report = RetentionReport(cutoff)
        held = {user_key(h.user_id) for h in await self.legal_holds()}
        counts = await self._payloads_before(time_us_of(cutoff))
        for user_id, count in counts:
            if user_key(user_id) in held:
                report.held.append(user_id)
                continue
            try:
                check_id("user_id", user_id)
            except InvalidIdError as exc:  # a trail key edited into no id: nothing reads it
                report.refused[user_id] = (
                    f"an audit trail is filed under a user id no writer makes ({exc}): it was "
                    "edited in the database, so nothing of it was erased; see "
                    "`loomflow audit verify`"
                )
                continue
            # A trail verify finds damaged in any way (an entry deleted, reordered, forged,
            # unreadable...) is evidence: routine retention leaves all of it as it is, and a
            # dry run says so too.
            damage = (await self.verify(user_id=user_id)).problems
            if damage:
                report.refused[user_id] = _damaged(user_id, damage)
            elif dry_run:
                report.erased[user_id] = count
            else:
                try:
                    done = await self.erase(
                        user_id, reason="retention", actor=actor, before=cutoff, always_record=False
                    )
                except AuditIntegrityError as exc:  # a changed entry: keep it for verify
                    report.refused[user_id] = str(exc)
                    continue
                if done.erased:
                    report.erased[user_id] = done.erased
        return report

    async def _payloads_before(self, before_us: int) -> list[tuple[str | None, int]]:
        """Users with payloads erasure would take that were written before ``before_us``,
        and how many; this default reads the entries."""
        counts: dict[str, tuple[str | None, int]] = {}
        async for entry in self.entries(until=before_us / 1_000_000):
            if entry.payload is None or entry.action in KEPT_BY_ERASURE:
                continue
            key = user_key(entry.user_id)
            counts[key] = (entry.user_id, counts.get(key, (None, 0))[1] + 1)
        return [counts[k] for k in sorted(counts)]

    # -- verification -----------------------------------------------------------------------

    async def verify(
        self,
        *,
        user_id: str | None = ANY_USER,
        on_progress: OnProgress | None = None,
        heads: Iterable[ChainHead] = (),
    ) -> VerifyReport:
        """Walk the chains (one user's, or all) and report every break, with its place.

        Args:
            user_id: Only this user's chain (all users when left out).
            on_progress: ``on_progress(done, total)``: the entries are counted first
                (:meth:`count`) and the callback hears after every 1000 stored items walked.
            heads: Heads saved earlier, away from this store (the ``heads`` of an older
                report, see :func:`~loomflow.audit.heads_from_json`). The entry at each saved
                head's ``seq`` must still be the one it names, and no trail may end before
                one: that catches a trail rewritten, head included, by someone who can
                write the storage.
        """
        if user_id is not ANY_USER:
            check_id("user_id", user_id)
        await self.open()
        only = None if user_id is ANY_USER else user_key(user_id)
        saved = _saved_by_user(heads, only)
        heads_now, items = await self._verify_source(only)
        report = VerifyReport()
        for key, head in list(heads_now.items()):
            heads_now[key], edited = _keyed(key, head)
            if edited:
                # No hash covers the head's user column, and the report's heads are what is
                # saved away: a head saved under another name would guard no trail.
                report.problems.append(
                    ChainProblem(
                        heads_now[key].user_id,
                        "head_mismatch",
                        head.seq,
                        None,
                        f"the recorded head of this trail names user {head.user_id!r:.80}: "
                        "the head was edited",
                    )
                )
        checker: _ChainCheck | None = None
        seen: set[str] = set()
        progress = Progress(
            on_progress,
            await self.count(user_id=user_id) if on_progress is not None else None,
            every=_PAGE,
        )
        async for key, position, item in items:
            progress.advance(1)
            if isinstance(item, ChainProblem) and item.seq is None:
                report.problems.append(item)  # a line that belongs to nobody
                continue
            if checker is None or checker.key != key:
                if checker is not None:
                    self._finish(checker, await self._head_after(checker, heads_now), report)
                checker = _ChainCheck(key, item.user_id, saved.get(key, ()))
                seen.add(key)
                report.users += 1
            if isinstance(item, ChainProblem):
                # A row that is there but cannot be read: reported as that, not also as a
                # gap in the chain; the link of the entry after it cannot be checked.
                report.problems.append(item)
                checker.skip(position, item, report)
                continue
            report.entries += 1
            checker.feed(position, item, report)
        if checker is not None:
            self._finish(checker, await self._head_after(checker, heads_now), report)
        for key, head in sorted(heads_now.items()):
            if key not in seen:  # every entry of the user is gone
                report.users += 1
                report.problems.append(
                    ChainProblem(
                        head.user_id,
                        "truncated",
                        1,
                        None,
                        f"all {head.seq} entries are missing (the head records seq {head.seq})",
                    )
                )
        for key, gone in sorted(saved.items()):
            if key not in seen and key not in heads_now:  # entries and head both deleted
                last = max(gone, key=lambda h: h.seq)
                report.users += 1
                report.problems.append(
                    ChainProblem(
                        last.user_id,
                        "truncated",
                        1,
                        None,
                        f"all entries and the head are missing, but a saved head records "
                        f"seq {last.seq}: the trail was deleted",
                    )
                )
        report.heads = [heads_now[k] for k in sorted(heads_now)]
        progress.finish()
        return report

    async def _head_after(
        self, checker: _ChainCheck, heads: dict[str, ChainHead]
    ) -> ChainHead | None:
        """The head to end ``checker``'s walk with: the one read before the walk, unless
        the walk found entries after it and the head recorded now covers them.

        Workers append while ``verify`` reads a live store: an append moves the head in its
        own transaction, after ``verify`` read the heads and before it read the entries. An
        entry added behind the store's back moves no head, so it stays unanchored.
        """
        head = heads.get(checker.key)
        if head is None or not 1 <= head.seq < checker.last_seq:
            return head
        try:
            now = (await self._heads(checker.key)).get(checker.key)
        except AuditIntegrityError:  # a head edited meanwhile: judged by the one read before
            return head
        if now is None or now.user_id != head.user_id or now.seq < checker.last_seq:
            return head
        if now.seq > checker.last_seq and checker.last_hash is not None:
            # Appended again since the walk read this trail: it ends at its last entry read.
            return ChainHead(now.user_id, checker.last_seq, checker.last_hash)
        return now

    def _finish(self, checker: _ChainCheck, head: ChainHead | None, report: VerifyReport) -> None:
        checker.finish(head, report, self.head_written_atomically)
        checker.finish_saved(report)
        checker.finish_erasures(report)

    async def _verify_source(
        self, only: str | None
    ) -> tuple[dict[str, ChainHead], AsyncIterator[ChainItem]]:
        """The recorded heads and the entries that ``verify`` compares them with.

        A backend whose heads and entries can be read apart from each other's writes
        overrides this to read them as one snapshot.
        """
        return await self._heads(only), self._chain_items(only)

    @abc.abstractmethod
    def _chain_items(self, only: str | None) -> AsyncIterator[ChainItem]:
        """Entries ordered by user key then ``seq``, with their storage position."""

    @abc.abstractmethod
    async def _heads(self, only: str | None) -> dict[str, ChainHead]:
        """The recorded head of every user (or of one user key)."""

    async def _head_pages(
        self, size: int
    ) -> AsyncIterator[list[tuple[str, ChainHead | ChainProblem]]]:
        """The heads with their trail keys, ``size`` at a time, in key order; a head row that
        reads as no head is its problem (see :meth:`iter_head_rows`).

        Backends whose heads sit in memory or in one file read them once; a database
        overrides this with keyset pages.
        """
        heads: list[tuple[str, ChainHead | ChainProblem]] = sorted(
            (await self._heads(None)).items()
        )
        for start in range(0, len(heads), size):
            yield heads[start : start + size]


@dataclass(frozen=True, slots=True)
class _Erased:
    """An entry whose payload is gone, waiting for an erasure record that covers it."""

    seq: int
    position: int
    rest: str | None  # version 1 or 2: the digest of everything but the payload
    time_us: int
    action: str
    hash_version: int

    @classmethod
    def of(cls, entry: AuditEntry, position: int, rest: str | None) -> _Erased:
        return cls(entry.seq, position, rest, entry.time_us, entry.action, entry.hash_version)


@dataclass(frozen=True, slots=True)
class _ErasureRecord:
    """What an ``audit.erasure`` entry says it erased, read the way erasure wrote it.

    :meth:`AuditStore.erase` (forget, retention) takes every hash version 3 entry before the
    record that was written before its ``before`` cut-off (all of them when it is ``null``);
    :meth:`AuditStore.erase_entries` (a forget's console looks) takes only its ``seqs``.
    Either takes an entry of hash version 1 or 2 only by listing its digest in ``pre_v3``,
    never the payload of an erasure record or a legal hold, and nothing at all when a legal
    hold stood as the record was written (erasure stops there).
    """

    seq: int
    pre_v3: dict[str, Any]
    seqs: frozenset[int] | None  # erase_entries: exactly these (None: a cut-off record)
    before_us: int | None  # erase(): its cut-off (None: everything before the record)
    cutoff_readable: bool
    void: bool  # written under a legal hold: it erased nothing

    @classmethod
    def of(cls, seq: int, payload: dict[str, Any], *, held: bool) -> _ErasureRecord:
        old = payload.get("pre_v3")
        listed, before_us, readable = None, None, True
        if "seqs" in payload:
            raw = payload["seqs"]
            numbers = raw if isinstance(raw, list) else []
            # 5.0 is 5 in the canonical form the record's digest covers (and to JSON readers).
            listed = frozenset(
                int(s) for s in numbers if type(s) is int or (type(s) is float and s.is_integer())
            )
        elif payload.get("before") is not None:
            try:
                before_us = time_us_of_text(payload["before"])
            except ValueError:
                readable = False
        return cls(seq, old if isinstance(old, dict) else {}, listed, before_us, readable, held)

    @property
    def sweeps(self) -> bool:
        """Whether it takes version 3 payloads by their time (a forget's or retention's)."""
        return not self.void and self.seqs is None and self.cutoff_readable

    def wider(self, other: _ErasureRecord) -> bool:
        """Whether its cut-off reaches later than ``other``'s (both sweep)."""
        if self.before_us is None or other.before_us is None:
            return self.before_us is None and other.before_us is not None
        return self.before_us > other.before_us

    def covers(self, gone: _Erased) -> bool:
        """Whether erasure under this record took ``gone``'s payload."""
        if self.void or gone.seq >= self.seq or gone.action in KEPT_BY_ERASURE:
            return False
        if self.seqs is not None and gone.seq not in self.seqs:
            return False
        if gone.hash_version < DIGESTED_VERSION:
            return str(gone.seq) in self.pre_v3
        if self.seqs is not None:
            return True
        return self.cutoff_readable and (self.before_us is None or gone.time_us < self.before_us)

    def describe(self) -> str:
        if self.void:
            return f"the one at seq {self.seq} was written under a legal hold and erased nothing"
        if self.seqs is not None:
            return f"the one at seq {self.seq} erased {_seq_list(self.seqs)} only"
        if not self.cutoff_readable:
            return f"the one at seq {self.seq} has a cut-off that is not a time"
        if self.before_us is None:
            return f"the one at seq {self.seq} erased every payload before it"
        before = iso_time(self.before_us)
        return f"the one at seq {self.seq} erased what was written before {before}"


def _uncovered(gone: _Erased, later: list[_ErasureRecord]) -> str:
    """Why none of the erasure records after an erased entry covers it, in words."""
    if gone.action in KEPT_BY_ERASURE:
        return f"erasure keeps the payloads of {gone.action} entries"
    shown = "; ".join(record.describe() for record in later[:3])
    more = f"; and {len(later) - 3} more" if len(later) > 3 else ""
    return f"{shown}{more} (entry {gone.seq} was written at {iso_time(gone.time_us)})"


def _seq_list(seqs: Iterable[int]) -> str:
    """``entries 2, 4 and 75-87`` (``no entries`` for none)."""
    ordered = sorted(seqs)
    if not ordered:
        return "no entries"
    runs: list[list[int]] = []
    for seq in ordered:
        if runs and seq == runs[-1][-1] + 1:
            runs[-1].append(seq)
        else:
            runs.append([seq])
    parts = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    if len(parts) > 6:
        parts = [*parts[:5], f"{len(parts) - 5} more runs"]
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{'entry' if len(ordered) == 1 else 'entries'} {text}"


def _span(first: int, last: int) -> str:
    return f"entry {first}" if first == last else f"entries {first}-{last}"


def _user_of_key(key: str, fallback: str | None) -> str | None:
    """The user whose trail key ``key`` is (the key is ``user_key(user_id)``); ``fallback``
    for a key no writer makes (a row edited to a key that is not a JSON string or null)."""
    try:
        user = json.loads(key)
    except (ValueError, RecursionError):
        return fallback
    return user if user is None or isinstance(user, str) else fallback


def names_trail(key: str) -> bool:
    """Whether ``key`` is a trail key as writers make it: ``user_key`` of an id or of none."""
    return user_key(_user_of_key(key, "")) == key


def malformed_head(key: str, why: str) -> ChainProblem:
    """The problem of a head row of trail ``key`` that reads as no head (``why``)."""
    return ChainProblem(
        _user_of_key(key, None),
        "head_mismatch",
        None,
        None,
        f"the recorded head of this trail is malformed ({why}): the head was edited",
    )


def _keyed(key: str, head: ChainHead) -> tuple[ChainHead, bool]:
    """``head`` as the head of the trail stored under ``key``: named for the key's user, and
    whether its user column named someone else (edited: no hash covers it)."""
    owner = _user_of_key(key, head.user_id)
    if user_key(owner) == key and head.user_id != owner:
        return ChainHead(owner, head.seq, head.hash), True
    return head, False


class _ChainCheck:
    """Checks the entries stored under one user's trail key, fed in ``seq`` order.

    Problems are reported as the key's user's, since the key is the trail that queries,
    erasure and the heads go by; only an entry that is not that user's own (moved under
    another key) is reported as its own user's.
    """

    def __init__(self, key: str, user_id: str | None, saved: Iterable[ChainHead] = ()) -> None:
        self.key = key
        self.user_id = _user_of_key(key, user_id)
        self.expected = 1
        self.prev_hash: str | None = GENESIS
        self.prev_position: int | None = None
        self.last_seq = 0
        self.last_hash: str | None = None
        self.first_seq: int | None = None
        # Heads saved away from the store: (seq, hash) pairs the trail must still hold.
        self.saved = sorted({(h.seq, h.hash) for h in saved})
        self.saved_at = {seq for seq, _ in self.saved}
        # Erased payloads wait for an erasure record after them that covers them; the
        # records seen; and whether a legal hold stands at this point of the trail.
        self.erased: list[_Erased] = []
        self.records: list[_ErasureRecord] = []
        self.held = False

    def _problem(
        self, report: VerifyReport, kind: ProblemKind, seq: int | None, pos: int | None, text: str
    ) -> None:
        report.problems.append(ChainProblem(self.user_id, kind, seq, pos, text))

    def start_at(self, entry: AuditEntry) -> None:
        """Begin mid-chain at ``entry`` (an export from a date on): its own link is unchecked."""
        self.expected = entry.seq
        self.prev_hash = entry.prev_hash
        self.last_seq = entry.seq - 1

    def skip(self, position: int, problem: ChainProblem, report: VerifyReport) -> None:
        """The stored entry at ``problem.seq`` cannot be read (``problem`` says so): the
        entries before it must still be there, and the chain goes on after it."""
        seq = problem.seq
        assert seq is not None
        if not 1 <= seq <= MAX_EXACT_INT:
            # A seq no entry can have (edited to 2**63 - 1, say): it marks no place in the
            # chain, so it claims no gap before it and no entries past the head.
            return
        if self.first_seq is None:
            self.first_seq = seq
        if seq <= self.last_seq:
            return  # a second row claiming a seq: the unreadable report is enough
        if seq > self.expected:
            self._gap(report, seq, position)
        self.expected = seq + 1
        self.prev_hash = None  # unknown: the next entry's link goes unchecked
        self.prev_position = position
        self.last_seq = seq
        self.last_hash = None

    def _gap(self, report: VerifyReport, seq: int, position: int) -> None:
        gap = _span(self.expected, seq - 1) + (" is" if seq - 1 == self.expected else " are")
        self._problem(
            report, "missing", self.expected, position, f"{gap} missing before entry {seq}: deleted"
        )

    def feed(self, position: int, entry: AuditEntry, report: VerifyReport) -> None:
        seq = entry.seq
        if self.first_seq is None:
            self.first_seq = seq
        if user_key(entry.user_id) != self.key:
            # The key is what queries and erasure look up, and no hash covers it: entries
            # moved under another key verify as a chain but vanish from their user's trail.
            # The entry is its own user's problem; the gaps it leaves are the key's.
            report.problems.append(
                ChainProblem(
                    entry.user_id,
                    "edited",
                    seq,
                    position,
                    f"entry {seq} of user {entry.user_id!r} is filed under the trail key "
                    f"{self.key[:80]!r}: its user's queries and erasure would miss it",
                )
            )
        changed, why = self._content(entry, position, report)
        if changed:
            self._problem(report, "edited", seq, position, f"entry {seq} was changed: {why}")
        elif entry.action == AUDIT_ERASURE and isinstance(entry.payload, dict):
            self.records.append(_ErasureRecord.of(seq, entry.payload, held=self.held))
        if entry.action in _HOLD_ACTIONS:
            self.held = entry.action == LEGAL_HOLD_PLACED
        if seq in self.saved_at:
            for saved_seq, saved_hash in self.saved:
                if saved_seq == seq and saved_hash != entry.hash:
                    # Rewritten from here on with fresh hashes: the chain itself is whole
                    # again, only the copy kept elsewhere can tell.
                    self._problem(
                        report,
                        "head_mismatch",
                        seq,
                        position,
                        f"entry {seq} is not the entry a saved head recorded at seq {seq}: "
                        "the trail was rewritten",
                    )
        if seq <= self.last_seq:
            self._problem(report, "duplicate", seq, position, f"a second entry claims seq {seq}")
            return
        if seq > self.expected:
            self._gap(report, seq, position)
        elif self.prev_hash is not None and entry.prev_hash != self.prev_hash:
            self._problem(
                report,
                "broken_link",
                seq - 1 if seq > 1 else seq,
                position,
                f"entry {seq} does not link to entry {seq - 1}: entry {seq - 1} was replaced "
                "or rewritten",
            )
        if self.prev_position is not None and position < self.prev_position:
            self._problem(
                report,
                "reordered",
                seq,
                position,
                f"entry {seq} is stored at {position}, before entry {self.last_seq} "
                f"(at {self.prev_position}): the trail was reordered",
            )
        self.expected = seq + 1
        self.prev_hash = entry.hash
        self.prev_position = position
        self.last_seq = seq
        self.last_hash = entry.hash

    def _content(self, entry: AuditEntry, position: int, report: VerifyReport) -> tuple[bool, str]:
        """Whether the entry's content was changed, and how; notes an erased payload."""
        if entry.schema_version != ENTRY_SCHEMA_VERSION:
            # Its hash may match, but its fields may mean what this loomflow cannot tell:
            # vouching for it would be a guess (and a rewrite can relabel any entry so).
            return True, (
                f"its layout is schema version {entry.schema_version}, which this loomflow "
                f"does not know (it reads version {ENTRY_SCHEMA_VERSION})"
            )
        if entry.payload is None:
            report.erased += 1
            if entry.hash_version < DIGESTED_VERSION:
                # Its hash covered the payload: only an erasure record's digest of the other
                # fields vouches for them now (checked in finish_erasures).
                try:
                    rest: str | None = entry.rest_digest()
                except AuditError:
                    rest = "unhashable"
                self.erased.append(_Erased.of(entry, position, rest))
                return False, ""
            self.erased.append(_Erased.of(entry, position, None))
        try:
            if entry.computed_hash() != entry.hash:
                return True, "it no longer matches its hash"
        except AuditError as exc:  # e.g. a NaN or a huge integer written into the storage
            return True, f"its content cannot be hashed ({exc})"
        problem = entry.payload_problem()
        return (True, problem) if problem is not None else (False, "")

    def finish_erasures(self, report: VerifyReport) -> None:
        """Every erased payload needs an erasure record after it that covers it: by its
        cut-off or list of seqs, as erasure chose what to erase. An erased version 1 or 2 entry
        must also match the digest the record kept of its other fields."""
        if not self.erased:
            return
        # covers() decides; these indexes only pick the records that could, so that a long
        # trail under daily retention (thousands of records) is not a records-times-entries
        # walk: 200,000 erased entries under 1,000 records took 33 s that way, 0.15-0.3 s
        # this way.
        records = sorted(self.records, key=lambda record: record.seq)
        record_seqs = [record.seq for record in records]
        widest: list[_ErasureRecord | None] = [None] * (len(records) + 1)
        for i in range(len(records) - 1, -1, -1):  # the widest cut-off from each record on
            record, best = records[i], widest[i + 1]
            widest[i] = record if record.sweeps and (best is None or record.wider(best)) else best
        naming: dict[int, list[_ErasureRecord]] = {}  # seq -> the records that list it
        for record in records:
            listed = {int(k) for k in record.pre_v3 if k.isascii() and k.isdigit()}
            for named in listed | (record.seqs or frozenset()):
                naming.setdefault(named, []).append(record)
        for gone in self.erased:
            seq = gone.seq
            after = bisect.bisect_right(record_seqs, seq)
            candidates = [r for r in naming.get(seq, ()) if r.seq > seq]
            sweeping = widest[after]
            if sweeping is not None:
                candidates.append(sweeping)
            covering = [record for record in candidates if record.covers(gone)]
            if after == len(records):
                self._problem(
                    report,
                    "erased",
                    seq,
                    gone.position,
                    f"the payload of entry {seq} is gone, but no erasure record follows it",
                )
            elif not covering:
                self._problem(
                    report,
                    "erased",
                    seq,
                    gone.position,
                    f"the payload of entry {seq} (hash version 1 or 2) is gone, but no erasure "
                    "record vouches for its other fields"
                    if gone.rest is not None
                    else f"the payload of entry {seq} is gone, but no erasure record covers it: "
                    + _uncovered(gone, records[after:]),
                )
            elif gone.rest is not None and not any(
                record.pre_v3.get(str(seq)) == gone.rest for record in covering
            ):
                self._problem(
                    report,
                    "edited",
                    seq,
                    gone.position,
                    f"entry {seq} was changed after its payload was erased",
                )

    def finish(self, head: ChainHead | None, report: VerifyReport, strict: bool) -> None:
        if head is None:
            target = report.problems if strict else report.warnings
            target.append(
                ChainProblem(
                    self.user_id, "unanchored", 1, None, "no head is recorded for this user"
                )
            )
        elif head.seq < 1:
            # A head is written with the first entry: one before it was edited, and is no
            # place the entries could have grown past.
            self._problem(
                report,
                "head_mismatch",
                head.seq,
                None,
                f"the recorded head names seq {head.seq}, which no entry has: it was edited",
            )
        elif head.seq > self.last_seq:
            gap = (
                f"entry {head.seq} is"
                if head.seq == self.last_seq + 1
                else f"entries {self.last_seq + 1}-{head.seq} are"
            )
            self._problem(
                report,
                "truncated",
                self.last_seq + 1,
                None,
                f"{gap} missing at the end: the trail was truncated",
            )
        elif head.seq == self.last_seq and self.last_hash not in (None, head.hash):
            self._problem(
                report,
                "head_mismatch",
                head.seq,
                None,
                f"the last entry ({head.seq}) is not the one recorded as the head",
            )
        elif head.seq < self.last_seq:
            target = report.problems if strict else report.warnings
            comes = "comes" if head.seq + 1 == self.last_seq else "come"
            target.append(
                ChainProblem(
                    self.user_id,
                    "unanchored",
                    head.seq + 1,
                    None,
                    f"{_span(head.seq + 1, self.last_seq)} {comes} after the recorded head "
                    f"(seq {head.seq})",
                )
            )

    def finish_saved(self, report: VerifyReport) -> None:
        """Compare the end of the walk with the saved heads (after :meth:`finish`)."""
        if not self.saved:
            return
        furthest = self.saved[-1][0]
        if furthest > self.last_seq:
            gap = (
                f"entry {furthest} is"
                if furthest == self.last_seq + 1
                else f"entries {self.last_seq + 1}-{furthest} are"
            )
            self._problem(
                report,
                "truncated",
                self.last_seq + 1,
                None,
                f"{gap} missing at the end: a saved head records seq {furthest}",
            )
        earliest = self.saved[0][0]
        if self.first_seq is not None and earliest < self.first_seq:
            report.warnings.append(
                ChainProblem(
                    self.user_id,
                    "unanchored",
                    earliest,
                    None,
                    f"a saved head records seq {earliest}, before the first entry checked "
                    f"({self.first_seq}): it cannot be compared here",
                )
            )


def _saved_by_user(heads: Iterable[ChainHead], only: str | None) -> dict[str, list[ChainHead]]:
    """Saved heads grouped by user key (only one user's with ``only``)."""
    grouped: dict[str, list[ChainHead]] = {}
    for head in heads:
        if not isinstance(head, ChainHead):
            raise UserError(f"heads must be ChainHead objects, not {type(head).__name__}")
        key = user_key(head.user_id)
        if only is None or key == only:
            grouped.setdefault(key, []).append(head)
    return grouped


_HOLD_ACTIONS = (LEGAL_HOLD_PLACED, LEGAL_HOLD_RELEASED)
_MAX_SEQ = 2**63 - 1  # a BIGINT, and the largest INTEGER SQLite stores


def _parse_cursor(cursor: str | None) -> int | None:
    if cursor is None:
        return None
    # ASCII digits only (str.isdigit also takes "²", which int() refuses), and a seq the
    # databases can hold: anything else was not a next_cursor we gave out.
    if (
        not isinstance(cursor, str)
        or not (cursor.isascii() and cursor.isdigit())
        or len(cursor) > 19  # before int(): Python refuses to parse over 4,300 digits
        or int(cursor) > _MAX_SEQ
    ):
        shown = cursor[:40] if isinstance(cursor, str) else cursor
        raise UserError(f"bad cursor {shown!r}: pass the next_cursor of a previous page")
    return int(cursor)


def damaged_row(problem: ChainProblem) -> dict[str, Any]:
    """The marker that stands in an export (or a ``users export``'s ``audit`` list) for a
    row that reads as no entry: why (``"unreadable"``, the key a damaged entry's line has),
    its row id, and its user and seq as far as they could be read. It has no ``hash`` and no
    ``time``, so no verifier or consumer takes it for an entry."""
    return {
        UNREADABLE: problem.detail,
        "row": problem.position,
        "user_id": problem.user_id,
        "seq": problem.seq,
    }


def export_line(row: AuditEntry | ChainProblem) -> str:
    """A row's line in an export (no newline): the entry, or for a row that reads as no
    entry, its marker (:func:`damaged_row`)."""
    return json_line(damaged_row(row)) if isinstance(row, ChainProblem) else row.to_line()


def _batch(records: AuditRecord | Iterable[AuditRecord]) -> list[AuditRecord]:
    batch = [records] if isinstance(records, AuditRecord) else list(records)
    for record in batch:
        if not isinstance(record, AuditRecord):
            raise UserError(f"append() takes AuditRecord objects, not {type(record).__name__}")
    return batch


def _check_text(what: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise UserError(f"{what} must be a non-empty string without NUL, not {value!r}")


def _hold_of(entry: AuditEntry | None) -> LegalHold | None:
    if entry is None or entry.action != LEGAL_HOLD_PLACED:
        return None
    reason = (entry.payload or {}).get("reason")
    return LegalHold(
        entry.user_id,
        reason if isinstance(reason, str) else "(reason not readable)",
        entry.actor,
        entry.time,
        entry.seq,
    )


def erasure_problem(entry: AuditEntry) -> str | None:
    """Why ``entry`` no longer matches its hash or its payload digest, or ``None``.

    Erasing a payload takes away what these checks need: an erased version 3 payload can no
    longer be held against its digest, and the erasure record vouches for the other fields
    of a version 1 or 2 entry by a digest taken at erasure time. So an entry that was edited
    or forged in the database must not have its payload erased: ``verify`` would then find
    nothing wrong.
    """
    try:
        if entry.computed_hash() != entry.hash:
            return "it no longer matches its hash"
    except AuditError as exc:
        return f"its content cannot be hashed ({exc})"
    return entry.payload_problem()


def _damaged(user_id: str | None, problems: Sequence[ChainProblem]) -> str:
    """Why retention leaves a trail alone: verify's problems, by kind, with their entries."""
    kinds: dict[str, list[int]] = {}
    for problem in problems:
        kinds.setdefault(problem.kind, []).extend([] if problem.seq is None else [problem.seq])
    found = "; ".join(
        f"{kind}: {_seq_list(seqs)}" if seqs else kind for kind, seqs in kinds.items()
    )
    check = "--anonymous" if user_id is None else f"--user {shlex.quote(user_id)}"
    return (
        f"the audit trail of {user_label(user_id)} is damaged ({found}), so nothing of it was "
        f"erased; see `loomflow audit verify {check}`"
    )


def _refuse_changed(user_id: str | None, seqs: Sequence[int]) -> None:
    if not seqs:
        return
    shown = ", ".join(str(seq) for seq in seqs[:10]) + (", ..." if len(seqs) > 10 else "")
    one = len(seqs) == 1
    raise AuditIntegrityError(
        f"{'an entry' if one else f'{len(seqs)} entries'} of the audit trail of "
        f"{user_label(user_id)} (seq {shown}) no longer {'matches its' if one else 'match their'} "
        "hash, edited or forged in the database: erasing payloads would hide that, so nothing "
        "was erased; see `loomflow audit verify`"
    )


def _refuse_uncovered(user_id: str | None, seqs: Sequence[int]) -> None:
    if not seqs:
        return
    shown = ", ".join(str(seq) for seq in seqs[:10]) + (", ..." if len(seqs) > 10 else "")
    raise AuditIntegrityError(
        f"the audit trail of {user_label(user_id)} holds {len(seqs)} payload(s) erased with no "
        f"erasure record that covers them (seq {shown}), removed in the database: a new "
        "erasure record would cover them and hide that, so nothing was erased; see "
        "`loomflow audit verify`"
    )


def _held(hold: LegalHold, already: str = "") -> LegalHoldError:
    return LegalHoldError(
        f"{user_label(hold.user_id)} is {already}under legal hold since "
        f"{iso_time(time_us_of(hold.placed_at))} (placed by {hold.actor}: {hold.reason}); "
        "nothing of theirs may be erased until `loomflow users release` lifts it",
        user_id=hold.user_id,
        reason=hold.reason,
    )


def _remove(path: Path) -> None:
    """Remove a file an export failed to finish, if it can."""
    with contextlib.suppress(OSError):
        path.unlink()
