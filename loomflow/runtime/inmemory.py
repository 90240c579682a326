"""A journal in process memory: for tests and for agents that need no durability.

It keeps the same semantics as the database backends (epochs, fencing tokens, idempotency
keys, pruning) so that one conformance suite covers all three.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._progress import OnProgress, Progress
from ..config import Settings
from . import _lease
from ._journal import JournalRuntime
from ._states import run_state
from ._store import (
    RUN_STATES,
    Claim,
    EntryInfo,
    IdempotentInfo,
    LastRun,
    OrphanClaim,
    RunRow,
    Scope,
    SessionInfo,
    StoredEntry,
)

__all__ = ["InMemoryRuntime"]


@dataclass(slots=True)
class _SessionRow:
    session_id: str | None
    user_id: str | None
    epoch: int = 0
    open: bool = False
    owner: str | None = None
    token: int = 0
    lease_until: float = 0.0
    updated_at: float = 0.0
    agent: str | None = None
    config: str | None = None
    record: bytes | None = None
    status: str | None = None
    attempts: int = 0
    last_error: str | None = None
    retry_at: float = 0.0
    created_at: float = 0.0

    def state(self, now: float) -> str:
        return run_state(
            open=self.open,
            owner=self.owner,
            lease_until=self.lease_until,
            now=now,
            status=self.status,
            attempts=self.attempts,
        )


class InMemoryStore:
    backend = "memory"

    def __init__(self) -> None:
        self.sessions: dict[str, _SessionRow] = {}
        # scope -> epoch -> (path, name, fingerprint) -> (entry, created_at)
        self.entries: dict[str, dict[int, dict[tuple[str, str, str], tuple[StoredEntry, float]]]]
        self.entries = {}
        self.idempotent: dict[tuple[str, str], tuple[StoredEntry, float]] = {}
        # (user key, idempotency key) -> the session of the run that recorded the result, as
        # the SQL stores keep it in their row; read for a key still in ``idempotent`` only.
        self.idempotent_sessions: dict[tuple[str, str], str | None] = {}

    async def open(self, *, migrate: bool) -> None:
        return None

    async def close(self) -> None:
        return None

    async def migrate(self) -> int:
        return 0

    def _owned(self, scope: Scope, token: int) -> _SessionRow | None:
        row = self.sessions.get(scope.key)
        return row if row is not None and row.token == token else None

    async def try_acquire(self, scope: Scope, owner: str, lease_s: float) -> Claim | None:
        row = self.sessions.setdefault(scope.key, _SessionRow(scope.session_id, scope.user_id))
        if row.owner is not None and row.lease_until >= time.time():
            return None
        self._take(row, owner, lease_s)
        return Claim(row.token, row.epoch, row.open, row.status == "cancelled")

    async def try_begin(
        self, scope: Scope, owner: str, lease_s: float, record: tuple[str, str, bytes] | None
    ) -> Claim | None:
        row = self.sessions.setdefault(scope.key, _SessionRow(scope.session_id, scope.user_id))
        if row.open or (row.owner is not None and row.lease_until >= time.time()):
            return None
        self._take(row, owner, lease_s)
        self._open(row, record)
        return Claim(row.token, row.epoch, True, False)

    async def try_create(
        self, scope: Scope, owner: str, lease_s: float, record: tuple[str, str, bytes] | None
    ) -> Claim | None:
        if scope.key in self.sessions:
            return None
        row = self.sessions[scope.key] = _SessionRow(scope.session_id, scope.user_id)
        self._take(row, owner, lease_s)
        self._open(row, record)
        return Claim(row.token, row.epoch, True, False)

    @staticmethod
    def _take(row: _SessionRow, owner: str, lease_s: float) -> None:
        now = time.time()
        row.owner, row.token, row.lease_until = owner, row.token + 1, now + lease_s
        row.updated_at = now

    @staticmethod
    def _open(row: _SessionRow, record: tuple[str, str, bytes] | None) -> None:
        row.open = True
        row.agent, row.config, row.record = record if record is not None else (None, None, None)
        row.status, row.attempts, row.last_error, row.retry_at = None, 0, None, 0.0
        row.created_at = time.time()

    async def holder(self, scope: Scope) -> tuple[str, int] | None:
        row = self.sessions.get(scope.key)
        return (row.owner, row.token) if row is not None and row.owner is not None else None

    async def steal(
        self, scope: Scope, seen_token: int, owner: str, lease_s: float
    ) -> Claim | None:
        row = self._owned(scope, seen_token)
        if row is None:
            return None
        self._take(row, owner, lease_s)
        return Claim(row.token, row.epoch, row.open, row.status == "cancelled")

    async def renew(self, scope: Scope, token: int, lease_s: float) -> bool:
        row = self._owned(scope, token)
        if row is None or row.owner is None:
            return False
        row.lease_until = time.time() + lease_s
        return True

    async def begin_run(
        self, scope: Scope, token: int, record: tuple[str, str, bytes] | None = None
    ) -> bool:
        row = self._owned(scope, token)
        if row is None:
            return False
        self._open(row, record)
        return True

    async def reopen(self, scope: Scope, token: int, epoch: int) -> bool:
        row = self._owned(scope, token)
        if (
            row is None
            or row.owner is None
            or row.open
            or row.epoch != epoch + 1
            or row.status not in (None, "interrupted")
        ):
            return False
        row.open, row.epoch, row.status = True, epoch, None
        row.attempts, row.last_error, row.retry_at = 0, None, 0.0
        row.updated_at = time.time()
        return True

    async def release(
        self, scope: Scope, token: int, advance_to: int | None, status: str | None = None
    ) -> bool:
        row = self._owned(scope, token)
        if row is None:
            return False
        row.owner, row.lease_until, row.updated_at = None, 0.0, time.time()
        if advance_to is not None:
            row.epoch = max(row.epoch, advance_to)
            row.open = False
            row.status = status
        return True

    async def run_status(self, scope: Scope) -> str | None:
        row = self.sessions.get(scope.key)
        return row.status if row is not None else None

    async def run_record(self, scope: Scope) -> bytes | None:
        row = self.sessions.get(scope.key)
        return row.record if row is not None else None

    async def cancel(self, scope: Scope) -> bool:
        row = self.sessions.get(scope.key)
        if row is None:
            return False
        waiting = not row.open and row.status == "interrupted"  # closed, its epoch moved on
        if not waiting and (not row.open or row.status not in (None, "failed")):
            return False
        if row.open:
            row.epoch += 1
        row.status, row.owner, row.lease_until, row.open = "cancelled", None, 0.0, False
        row.token += 1
        row.updated_at = time.time()
        return True

    async def open_runs(self, limit: int, prefer: Sequence[str] = ()) -> list[RunRow]:
        now = time.time()
        rows = [
            row
            for row in self.sessions.values()
            if row.open
            and row.status is None
            and row.retry_at <= now
            and (row.owner is not None or row.attempts > 0)
        ]
        # Leases that ran out first: live runs must not fill the batch (see SqlJournalStore).
        rows.sort(
            key=lambda r: (
                r.agent not in prefer,
                not (r.owner is None or r.lease_until < now),
                r.retry_at,
                r.updated_at,
            )
        )
        return [
            RunRow(
                r.session_id,
                r.user_id,
                r.owner,
                r.token,
                r.lease_until,
                now,
                r.attempts,
                r.retry_at,
                r.agent,
                r.config,
                r.record,
                last_error=r.last_error,
            )
            for r in rows[:limit]
        ]

    async def claim_orphan(
        self,
        scope: Scope,
        seen_token: int,
        owner: str,
        lease_s: float,
        backoff_s: float,
        owner_dead: bool,
    ) -> OrphanClaim | None:
        now = time.time()
        row = self._owned(scope, seen_token)
        if row is None or not row.open or row.status is not None:
            return None
        if row.owner is not None and row.lease_until >= now and not owner_dead:
            return None
        row.owner, row.token, row.lease_until = owner, row.token + 1, now + lease_s
        row.attempts += 1
        row.retry_at, row.updated_at = now + backoff_s, now
        return OrphanClaim(row.token, row.attempts)

    async def dead_letter(self, scope: Scope, seen_token: int | None, error: str) -> bool:
        row = self.sessions.get(scope.key)
        if row is None or not row.open or row.status is not None:
            return False
        if seen_token is None:
            if row.owner is not None:
                return False
        elif row.token != seen_token:
            return False
        else:
            row.owner, row.lease_until, row.token = None, 0.0, row.token + 1
        row.status, row.last_error, row.updated_at = "failed", error, time.time()
        return True

    async def note_error(self, scope: Scope, error: str) -> None:
        row = self.sessions.get(scope.key)
        if row is not None and row.owner is None and row.open and row.status is None:
            row.last_error = error

    async def requeue(self, scope: Scope) -> bool:
        row = self.sessions.get(scope.key)
        if row is not None and row.owner is None and row.open and row.status is None:
            row.retry_at = 0.0
            row.attempts = max(1, row.attempts - 1)  # handed back, not failed (see _sql)
            return True
        return False

    async def count_states(self) -> dict[str, int]:
        now = time.time()
        counts = dict.fromkeys(RUN_STATES, 0)
        for row in self.sessions.values():
            state = row.state(now)
            counts[state] = counts.get(state, 0) + 1
        return counts

    async def load_run(self, scope: Scope, epoch: int) -> list[StoredEntry]:
        run = self.entries.get(scope.key, {}).get(epoch, {})
        return [entry for entry, _ in run.values()]

    async def peek_last_run(self, scope: Scope) -> LastRun | None:
        row = self.sessions.get(scope.key)
        if row is None:
            return None
        run = {} if row.open else self.entries.get(scope.key, {}).get(row.epoch - 1, {})
        entries = [entry for entry, _ in run.values()]
        return LastRun(row.token, row.epoch, row.open, row.status, row.owner is not None, entries)

    async def write_entry(self, scope: Scope, token: int, epoch: int, entry: StoredEntry) -> bool:
        if self._owned(scope, token) is None:
            return False
        run = self.entries.setdefault(scope.key, {}).setdefault(epoch, {})
        run[(entry.path, entry.name, entry.fingerprint)] = (entry, time.time())
        return True

    async def get_idempotent(self, user_key: str, key: str) -> StoredEntry | None:
        found = self.idempotent.get((user_key, key))
        return found[0] if found is not None else None

    async def put_idempotent(
        self,
        scope: Scope,
        token: int,
        key: str,
        entry: StoredEntry,
        *,
        replacing: StoredEntry | None = None,
    ) -> StoredEntry | None:
        existing = self.idempotent.get((scope.user_key, key))
        stale = (
            existing is not None
            and replacing is not None
            and existing[0].as_stored() == replacing.as_stored()
        )
        if existing is not None and not stale:
            return existing[0]
        if self._owned(scope, token) is None:
            return None
        self.idempotent[(scope.user_key, key)] = (entry, time.time())
        self.idempotent_sessions[(scope.user_key, key)] = scope.session_id
        return entry

    async def list_entries(self, session_id: str | None, user_id: str | None) -> list[EntryInfo]:
        runs = self.entries.get(Scope(session_id, user_id).key, {})
        infos = [
            EntryInfo(
                session_id,
                user_id,
                epoch,
                tuple(json.loads(e.path)),
                e.name,
                e.kind,
                len(e.value),
                e.seq,
                created,
            )
            for epoch, run in runs.items()
            for e, created in run.values()
        ]
        return sorted(infos, key=lambda i: (i.epoch, i.seq))

    async def list_idempotent(self, user_id: str | None) -> list[IdempotentInfo]:
        user_key = Scope(None, user_id).user_key
        found = [
            IdempotentInfo(
                user_id,
                key,
                self.idempotent_sessions.get((owner, key)),
                entry.name,
                entry.kind,
                len(entry.value),
                created,
            )
            for (owner, key), (entry, created) in self.idempotent.items()
            if owner == user_key
        ]
        return sorted(found, key=lambda i: (i.created_at, i.key))

    async def list_sessions(
        self,
        user_id: str | None,
        by_user: bool,
        limit: int,
        session_id: str | None = None,
        state: str | None = None,
    ) -> list[SessionInfo]:
        now = time.time()
        infos = [
            SessionInfo(
                row.session_id,
                row.user_id,
                row.epoch,
                row.open,
                row.owner,
                row.updated_at,
                sum(len(run) for run in self.entries.get(key, {}).values()),
                state=row.state(now),
                agent=row.agent,
                config=row.config,
                attempts=row.attempts,
                last_error=row.last_error,
                created_at=row.created_at,
            )
            for key, row in self.sessions.items()
            if (not by_user or row.user_id == user_id)
            and (session_id is None or row.session_id == session_id)
        ]
        if state is not None:
            infos = [i for i in infos if i.state == state]
        infos.sort(key=lambda i: i.updated_at, reverse=True)
        return infos[:limit]

    async def forget_sessions(self, user_id: str | None) -> int:
        now = time.time()
        gone = [
            key
            for key, row in self.sessions.items()
            if row.user_id == user_id
            and (row.owner is None or row.lease_until < now or _lease.holder_is_dead(row.owner))
            and not any(self.entries.get(key, {}).values())
        ]
        for key in gone:
            del self.sessions[key]
            self.entries.pop(key, None)
        return len(gone)

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
        cutoff = time.time() - older_than_s if older_than_s is not None else None
        if any_age:
            cutoff = float("inf")  # every row, whatever its time
        kept = {Scope(None, u).user_key for u in keep_users}
        doomed: list[tuple[dict[Any, Any], Any]] = []  # (container, key) of each row to drop
        for scope_key, runs in self.entries.items():
            row = self.sessions[scope_key]
            if (
                (by_session and row.session_id != session_id)
                or (by_user and row.user_id != user_id)
                or Scope(None, row.user_id).user_key in kept
            ):
                continue
            for epoch, run in runs.items():
                if not include_open and row.open and epoch == row.epoch:
                    continue
                doomed += [
                    (run, k)
                    for k, (_, created) in run.items()
                    if cutoff is None or created < cutoff
                ]
        if cutoff is not None and not by_session:
            user_key = Scope(None, user_id).user_key
            doomed += [
                (self.idempotent, key)
                for key, (_, created) in self.idempotent.items()
                if created < cutoff and (not by_user or key[0] == user_key) and key[0] not in kept
            ]
        if dry_run:
            return len(doomed)
        # Memory holds no locks, so batches here only pace the progress reports. There is no
        # await in between: no other coroutine ever sees a half-pruned journal.
        progress = Progress(on_progress, len(doomed) if on_progress is not None else None)
        for start in range(0, len(doomed), batch_size):
            batch = doomed[start : start + batch_size]
            for container, key in batch:
                del container[key]
                if container is self.idempotent:
                    self.idempotent_sessions.pop(key, None)
            progress.advance(len(batch))
        progress.finish()
        return progress.done


class InMemoryRuntime(JournalRuntime):
    """A journal that lives as long as this object: replay within one process only."""

    def __init__(self, *, settings: Settings | None = None, **options: Any) -> None:
        super().__init__(InMemoryStore(), settings=settings, **options)

    def __repr__(self) -> str:
        return "InMemoryRuntime()"
