"""The storage seam under the journal: one protocol, sibling backends.

The replay logic (``_journal.py``) is written once against :class:`JournalStore`; the
in-memory, SQLite and PostgreSQL backends only store and fetch rows. Every write that belongs
to a run carries the run's fencing token and is refused by the store when a newer owner has
taken the (session, user) turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._ids import check_id
from .._printable import is_unicode, printable
from .._progress import OnProgress
from . import codec

__all__ = [
    "Claim",
    "EntryInfo",
    "IdempotentInfo",
    "JournalStore",
    "LastRun",
    "OrphanClaim",
    "RUN_STATES",
    "RunRecord",
    "RunRow",
    "Scope",
    "SessionInfo",
    "StoredEntry",
    "fingerprint",
    "scope_session",
]

RUN_STATES = (
    "running",
    "orphaned",
    "open",
    "finished",
    "interrupted",
    "failed",
    "cancelled",
)
"""The states a run can be in, as ``runtime.sessions()`` and ``loomflow runs list`` report them.

``running``: a live owner holds its lease. ``orphaned``: open, but its lease ran out or its
owner's process is gone (or a recovery attempt raised and a retry is due): a recoverer picks
it up. ``open``: it raised to its caller and is resumable, but nothing retries it.
``finished``/``interrupted``: it returned an answer / returned stopped early. ``failed``:
recovery gave up after its attempts (a dead letter, with the last error). ``cancelled``:
someone cancelled it; it is never recovered. A row whose stored status no release wrote (a
hand-edited row) is reported as ``unreadable`` instead of failing the listing.
"""


def _key(*parts: str | None) -> str:
    # JSON arrays of strings/nulls are injective: no user id, however it is spelled
    # (quotes, separators, "None"), can produce another scope's key.
    return _compact(list(parts))


_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@dataclass(frozen=True, slots=True)
class Scope:
    """The (session, user) pair a run journals under. ``user_id=None`` is a bucket of its own."""

    session_id: str | None
    user_id: str | None
    key: str = field(init=False)
    user_key: str = field(init=False)

    @classmethod
    def checked(cls, session_id: object, user_id: object) -> Scope:
        """Build a scope from caller input, rejecting ids no backend can store (see
        :mod:`loomflow._ids`: the same rule on every backend, memory included)."""
        return cls(check_id("session_id", session_id), check_id("user_id", user_id))

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", _key(self.session_id, self.user_id))
        object.__setattr__(self, "user_key", _key(self.user_id))

    @property
    def shown(self) -> str:
        """The key as log lines and error texts name it: a line separator or a bidirectional
        override is a valid id character, and raw it forges or reorders what a reader sees."""
        return printable(self.key)


def scope_session(key: Any) -> str | None:
    """The session id a stored scope key names; ``None`` for the anonymous session or a key
    that cannot be read (a hand-edited row describes itself, it does not fail a listing)."""
    try:
        parts = json.loads(key)
    except (TypeError, ValueError, RecursionError):
        return None
    if isinstance(parts, list) and len(parts) == 2 and isinstance(parts[0], str):
        return parts[0]
    return None


def path_key(path: Sequence[str]) -> str:
    """Encode a sub-run path (a tuple of segments) injectively."""
    if not path:
        return "[]"  # the outermost run: every step of a plain run, no encoding needed
    return _key(*path)


def fingerprint(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """SHA-256 of the canonical tagged-JSON encoding of a step's inputs (resumed from a kept
    state for a growing first argument, see :class:`~loomflow.runtime.codec.GrowingList`)."""
    if not args and not kwargs:
        return _NO_INPUTS
    return codec.step_fingerprint(list(args), kwargs)


_NO_INPUTS = codec.step_fingerprint([], {})  # a step called with no arguments


@dataclass(frozen=True, slots=True)
class Claim:
    """What a store returns when a run takes the (session, user) turn.

    ``cancelled`` says whether the session's run was cancelled, read in the same statement
    as the claim; ``None`` (a store that does not read it) makes a resume ask
    :meth:`JournalStore.run_status` instead.
    """

    token: int
    epoch: int
    open: bool
    cancelled: bool | None = None


@dataclass(frozen=True, slots=True)
class LastRun:
    """A session's lease row and the entries of its last closed run, read in one statement
    by a resume that replays without taking the turn (see :meth:`JournalStore.peek_last_run`).

    ``epoch`` is the session's epoch (a closed run journaled under ``epoch - 1``); ``held``
    says a lease row names an owner, whether or not its lease ran out. ``entries`` is empty
    unless the run is closed.
    """

    token: int
    epoch: int
    open: bool
    status: str | None
    held: bool
    entries: list[StoredEntry]


@dataclass(slots=True)
class StoredEntry:
    """One journal row as the stores read and write it."""

    path: str
    name: str
    fingerprint: str
    kind: str  # "step" or "stream"
    format: str  # "json" or "pickle"
    codec_version: int
    value: bytes
    seq: int = 0
    # Set by a store on a row read back with a key no run position has (a hand-edited SQLite
    # epoch holding text): what is wrong with it. Such a row is reported, never replayed.
    damage: str | None = None
    # Set by a store on a row read back: its stored columns exactly as read (SQLite keeps any
    # type in any column, so a hand-edited row may hold an int or text where bytes belong,
    # which the fields above show as an unreadable entry). A conditional replace of the row
    # (``put_idempotent(replacing=...)``) matches on these, not on the fields above.
    row: tuple[Any, ...] | None = field(default=None, compare=False, repr=False)

    def as_stored(self) -> tuple[Any, ...]:
        """Format, codec version and value as the store holds them (``row`` when read back)."""
        if self.row is not None:
            return self.row
        return (self.format, self.codec_version, self.value)

    def damaged(self) -> str | None:
        """What makes the row one no step can match, or ``None``: a key no run position has
        (``damage``), or a key column that is not text (SQLite keeps any type in any column;
        a blob path or name is never looked up, so its step would run again)."""
        if self.damage is not None:
            return self.damage
        return key_damage(self.path, self.name, self.fingerprint)


def key_damage(path: object, name: object, fingerprint: object) -> str | None:
    """Which key column of a journal row no step can look up, and why, or ``None``."""
    for column, value in (("path", path), ("name", name), ("fingerprint", fingerprint)):
        if type(value) is not str:
            return f"a {type(value).__name__} for its {column}"
        if not is_unicode(value):
            # Bytes that are not UTF-8, read back as lone surrogates (storage/_sqlite.py).
            return f"text that is not UTF-8 for its {column}"
    return None


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """A journal row described for people and tools (no value).

    ``damage`` says why no step can match the row (a key column edited by hand: its step runs
    again on resume), or is ``None`` for a sound row.
    """

    session_id: str | None
    user_id: str | None
    epoch: int
    path: tuple[str, ...]
    name: str
    kind: str
    size: int
    seq: int
    created_at: float
    damage: str | None = None


@dataclass(frozen=True, slots=True)
class IdempotentInfo:
    """A result recorded under an idempotency key, described for people and tools (no
    value). It belongs to the user, not to a run: it outlives the run that recorded it.

    Attributes:
        user_id: Whose key it is (keys are scoped per user).
        key: The idempotency key.
        session_id: The session of the run that recorded the result (``None`` also when the
            row names no readable session).
        name: The step's name in that run.
        kind: ``"step"``.
        size: The encoded result's size in bytes.
        created_at: When it was recorded (Unix seconds).
    """

    user_id: str | None
    key: str
    session_id: str | None
    name: str
    kind: str
    size: int
    created_at: float


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """One (session, user) of the journal, as ``runs list`` shows it."""

    session_id: str | None
    user_id: str | None
    epoch: int  # the epoch the next new run will use
    open: bool  # the current epoch holds a run that raised or crashed (resumable)
    owner: str | None  # the worker holding the turn right now, if any
    updated_at: float
    entries: int
    state: str = "finished"  # one of RUN_STATES, or "unreadable" for a damaged row
    agent: str | None = None  # the registered name of the agent that opened the last run
    config: str | None = None  # that agent's configuration fingerprint
    attempts: int = 0  # recovery attempts of the open run
    last_error: str | None = None  # the last recovery failure (the dead letter's reason)
    created_at: float = 0.0  # when the last run began


@dataclass(frozen=True, slots=True)
class RunRecord:
    """What resuming a run needs without its caller, handed over when the run opens.

    The runtime does not read it: ``agent`` (the registered name) and ``config`` (a
    fingerprint of the agent's configuration) are stored as columns so that a recoverer can
    pick the agent and refuse a changed one; ``inputs`` (prompt, metadata, ...) is stored
    with the journal's tagged-JSON codec, never pickle, and read back the same way.
    """

    agent: str
    config: str
    inputs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RunRow:
    """An open run as a recoverer reads it (raw: the recoverer decides if it is orphaned)."""

    session_id: str | None
    user_id: str | None
    owner: str | None
    token: int
    lease_until: float
    now: float  # the database clock when the row was read
    attempts: int
    retry_at: float
    agent: str | None
    config: str | None
    record: bytes | None
    # Why no claim can take the run by the ids the row shows (a hand-edited session or user
    # column), or None.
    damage: str | None = None
    last_error: str | None = None  # why the last recovery attempt raised, if it did


@dataclass(frozen=True, slots=True)
class OrphanClaim:
    """A recoverer's claim on an orphaned run: the lease it holds and its attempt number."""

    token: int
    attempts: int
    owner: str = ""
    session_id: str | None = None
    user_id: str | None = None


class JournalStore(Protocol):
    """Storage operations the journal needs; implemented once per backend.

    Methods typed ``-> bool`` must answer ``True`` or ``False``: the journal raises
    :class:`~loomflow.errors.StorageError` for any other answer rather than read it as
    ``False`` (a dead letter, a cancel or a renewal it cannot know happened).
    """

    backend: str

    async def open(self, *, migrate: bool) -> None:
        """Connect and (optionally) bring the schema up to date."""

    async def close(self) -> None: ...

    async def migrate(self) -> int:
        """Apply pending migrations; return the schema version now in place."""

    async def try_acquire(self, scope: Scope, owner: str, lease_s: float) -> Claim | None:
        """Take the turn if nobody holds it or the holder's lease ran out."""

    async def try_begin(
        self, scope: Scope, owner: str, lease_s: float, record: tuple[str, str, bytes] | None
    ) -> Claim | None:
        """Take the turn and open a new run, in one write, if the turn is free *and* the
        session has no open run; else change nothing and return ``None``.

        What :meth:`try_acquire` then :meth:`begin_run` do, with one commit instead of two
        for the common case (a new run on a session whose last run closed). The claim it
        returns is open. A store may always return ``None``: the journal then claims and
        opens in two steps. (Stores written before 0.21 lack it; the journal does the same.)
        """

    async def try_create(
        self, scope: Scope, owner: str, lease_s: float, record: tuple[str, str, bytes] | None
    ) -> Claim | None:
        """Take the turn and open the session's first run, in one write, if the store holds
        no row for the scope at all; else change nothing and return ``None``.

        A fork's new session (``fork_session_id``): of two processes forking into one id,
        one gets the session and the other ``None``. Stores without it (written before
        0.21) get a check and a claim in two steps, which two processes can interleave.
        """

    async def holder(self, scope: Scope) -> tuple[str, int] | None:
        """The current holder's owner id and token, or ``None`` if the turn is free."""

    async def steal(
        self, scope: Scope, seen_token: int, owner: str, lease_s: float
    ) -> Claim | None:
        """Take the turn from a holder known to be dead, if it still holds ``seen_token``."""

    async def renew(self, scope: Scope, token: int, lease_s: float) -> bool: ...

    async def begin_run(
        self, scope: Scope, token: int, record: tuple[str, str, bytes] | None = None
    ) -> bool:
        """Mark the session's current epoch as holding an open run.

        ``record`` is (agent, config, encoded inputs), or ``None`` for a run opened without
        one; either way it replaces the last run's, and a new run starts with no status, no
        attempts and no last error.
        """

    async def reopen(self, scope: Scope, token: int, epoch: int) -> bool:
        """Open the closed run of ``epoch`` again for the holder of ``token``: the session's
        epoch goes back to it (the run's close had moved it on), its status and recovery
        attempts are cleared, its record stays. ``False`` when the token is not the holder's,
        or the last run is not that closed, finished or interrupted run."""

    async def release(
        self, scope: Scope, token: int, advance_to: int | None, status: str | None = None
    ) -> bool:
        """Give the turn back; with ``advance_to``, close the run (with ``status``, e.g.
        ``"interrupted"``) and move the epoch on."""

    async def run_status(self, scope: Scope) -> str | None:
        """The stored status of the session's run (``"cancelled"``, ...), if any."""

    async def cancel(self, scope: Scope) -> bool:
        """Mark the session's open or interrupted run cancelled (closing an open one) and
        fence out whoever runs it; a finished or already cancelled run is left alone."""

    async def open_runs(self, limit: int, prefer: Sequence[str] = ()) -> list[RunRow]:
        """Open runs with no final status that have an owner or a retry due: those of the
        agents named in ``prefer`` first, then oldest retry first."""

    async def claim_orphan(
        self,
        scope: Scope,
        seen_token: int,
        owner: str,
        lease_s: float,
        backoff_s: float,
        owner_dead: bool,
    ) -> OrphanClaim | None:
        """Take an orphaned run (if it still holds ``seen_token``) and count an attempt."""

    async def dead_letter(self, scope: Scope, seen_token: int | None, error: str) -> bool:
        """Mark the open run ``failed`` with ``error`` (only if it still holds
        ``seen_token``, or, with ``None``, if nobody holds it)."""

    async def note_error(self, scope: Scope, error: str) -> None:
        """Record a recovery attempt's failure on the open run nobody holds."""

    async def requeue(self, scope: Scope) -> bool:
        """Make the open run nobody holds due for recovery now (its worker stopped); False
        when no such run is there (held still, or closed)."""

    async def count_states(self) -> dict[str, int]:
        """How many sessions are in each state (see :data:`RUN_STATES`)."""

    async def load_run(self, scope: Scope, epoch: int) -> list[StoredEntry]:
        """Every entry of one run, in one query."""

    async def peek_last_run(self, scope: Scope) -> LastRun | None:
        """The lease row of (session, user) and the entries of its last run if that run is
        closed, in one consistent read that changes nothing; ``None`` when there is no row
        (or it is damaged: the claim then reports it).

        A resume of a closed run replays from this without taking the turn, and takes it only
        when a step has to run. A store may lack it (stores written before 0.21): every
        resume then takes the turn first.
        """

    async def write_entry(self, scope: Scope, token: int, epoch: int, entry: StoredEntry) -> bool:
        """Insert or replace an entry; ``False`` if ``token`` no longer owns the scope."""

    async def get_idempotent(self, user_key: str, key: str) -> StoredEntry | None: ...

    async def put_idempotent(
        self,
        scope: Scope,
        token: int,
        key: str,
        entry: StoredEntry,
        *,
        replacing: StoredEntry | None = None,
    ) -> StoredEntry | None:
        """Record a result under an idempotency key.

        Returns the entry that is stored afterwards (ours, or an earlier writer's), or
        ``None`` if ``token`` no longer owns the scope. With ``replacing`` (an entry read under
        the key that could not be decoded), overwrite that entry if it is still the one stored:
        the row must be found again whatever its columns hold (a hand-edited row too; see
        :attr:`StoredEntry.row`), or every retry would run the step again.
        """

    async def list_entries(
        self, session_id: str | None, user_id: str | None
    ) -> list[EntryInfo]: ...

    async def list_idempotent(self, user_id: str | None) -> list[IdempotentInfo]:
        """The results recorded under the user's idempotency keys, oldest first, described
        without their values (``users export``). A store may lack it (stores written before
        0.21): the journal then says it cannot list them."""

    async def list_sessions(
        self,
        user_id: str | None,
        by_user: bool,
        limit: int,
        session_id: str | None = None,
        state: str | None = None,
    ) -> list[SessionInfo]:
        """Sessions newest first; of ``user_id`` when ``by_user``; only ``session_id`` if given;
        only runs in ``state`` if given."""

    async def forget_sessions(self, user_id: str | None) -> int:
        """Delete the user's session rows that hold no entries and that no live run leases
        (a lease whose holder is known dead, see ``_lease.holder_is_dead``, counts as none);
        return how many went."""

    async def prune(
        self,
        *,
        older_than_s: float | None,
        session_id: str | None,
        by_session: bool,
        user_id: str | None,
        by_user: bool,
        include_open: bool,
        batch_size: int,
        on_progress: OnProgress | None,
        dry_run: bool = False,
        keep_users: Sequence[str | None] = (),
        any_age: bool = False,
    ) -> int:
        """Delete what the filters select, ``batch_size`` rows per statement (with
        ``dry_run``, only count it), except anything of the users in ``keep_users`` (under
        legal hold). ``any_age`` (an erasure) selects rows whatever time they carry, also
        one "from the future" or with no readable time. A store written before 0.21 may lack
        both: the journal then refuses a prune that must keep someone, and erases by age 0.

        With ``on_progress``, count the rows first and report ``(done, total)`` through a
        ``loomflow._progress.Progress``; without it, count nothing.
        """
