"""The storage seam under the journal: one protocol, sibling backends.

The replay logic (``_journal.py``) is written once against :class:`JournalStore`; the
in-memory, SQLite and PostgreSQL backends only store and fetch rows. Every write that belongs
to a run carries the run's fencing token and is refused by the store when a newer owner has
taken the (session, user) turn.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._ids import check_id
from .._progress import OnProgress
from . import codec

__all__ = [
    "Claim",
    "EntryInfo",
    "JournalStore",
    "Scope",
    "SessionInfo",
    "StoredEntry",
    "fingerprint",
]


def _key(*parts: str | None) -> str:
    # JSON arrays of strings/nulls are injective: no user id, however it is spelled
    # (quotes, separators, "None"), can produce another scope's key.
    return json.dumps(list(parts), ensure_ascii=False, separators=(",", ":"))


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


def path_key(path: Sequence[str]) -> str:
    """Encode a sub-run path (a tuple of segments) injectively."""
    return _key(*path)


def fingerprint(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """SHA-256 of the canonical tagged-JSON encoding of a step's inputs."""
    return hashlib.sha256(codec.canonical_bytes([list(args), kwargs])).hexdigest()


@dataclass(frozen=True, slots=True)
class Claim:
    """What a store returns when a run takes the (session, user) turn."""

    token: int
    epoch: int
    open: bool


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


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """A journal row described for people and tools (no value)."""

    session_id: str | None
    user_id: str | None
    epoch: int
    path: tuple[str, ...]
    name: str
    kind: str
    size: int
    seq: int
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


class JournalStore(Protocol):
    """Storage operations the journal needs; implemented once per backend."""

    backend: str

    async def open(self, *, migrate: bool) -> None:
        """Connect and (optionally) bring the schema up to date."""

    async def close(self) -> None: ...

    async def migrate(self) -> int:
        """Apply pending migrations; return the schema version now in place."""

    async def try_acquire(self, scope: Scope, owner: str, lease_s: float) -> Claim | None:
        """Take the turn if nobody holds it or the holder's lease ran out."""

    async def holder(self, scope: Scope) -> tuple[str, int] | None:
        """The current holder's owner id and token, or ``None`` if the turn is free."""

    async def steal(
        self, scope: Scope, seen_token: int, owner: str, lease_s: float
    ) -> Claim | None:
        """Take the turn from a holder known to be dead, if it still holds ``seen_token``."""

    async def renew(self, scope: Scope, token: int, lease_s: float) -> bool: ...

    async def begin_run(self, scope: Scope, token: int) -> bool:
        """Mark the session's current epoch as holding an open run."""

    async def release(self, scope: Scope, token: int, advance_to: int | None) -> bool:
        """Give the turn back; with ``advance_to``, close the run and move the epoch on."""

    async def load_run(self, scope: Scope, epoch: int) -> list[StoredEntry]:
        """Every entry of one run, in one query."""

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
        the key that could not be decoded), overwrite that entry if it is still the one stored.
        """

    async def list_entries(
        self, session_id: str | None, user_id: str | None
    ) -> list[EntryInfo]: ...

    async def list_sessions(
        self, user_id: str | None, by_user: bool, limit: int, session_id: str | None = None
    ) -> list[SessionInfo]:
        """Sessions newest first; of ``user_id`` when ``by_user``; only ``session_id`` if given."""

    async def forget_sessions(self, user_id: str | None) -> int:
        """Delete the user's session rows that hold no entries and that no live run leases;
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
    ) -> int:
        """Delete what the filters select, ``batch_size`` rows per statement (with
        ``dry_run``, only count it).

        With ``on_progress``, count the rows first and report ``(done, total)`` through a
        ``loomflow._progress.Progress``; without it, count nothing.
        """
