"""A journal in process memory: for tests and for agents that need no durability.

It keeps the same semantics as the database backends (epochs, fencing tokens, idempotency
keys, pruning) so that one conformance suite covers all three.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from .._progress import OnProgress, Progress
from ..config import Settings
from ._journal import JournalRuntime
from ._store import Claim, EntryInfo, Scope, SessionInfo, StoredEntry

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


class InMemoryStore:
    backend = "memory"

    def __init__(self) -> None:
        self.sessions: dict[str, _SessionRow] = {}
        # scope -> epoch -> (path, name, fingerprint) -> (entry, created_at)
        self.entries: dict[str, dict[int, dict[tuple[str, str, str], tuple[StoredEntry, float]]]]
        self.entries = {}
        self.idempotent: dict[tuple[str, str], tuple[StoredEntry, float]] = {}

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
        now = time.time()
        row = self.sessions.setdefault(scope.key, _SessionRow(scope.session_id, scope.user_id))
        if row.owner is not None and row.lease_until >= now:
            return None
        row.owner, row.token, row.lease_until = owner, row.token + 1, now + lease_s
        row.updated_at = now
        return Claim(row.token, row.epoch, row.open)

    async def holder(self, scope: Scope) -> tuple[str, int] | None:
        row = self.sessions.get(scope.key)
        return (row.owner, row.token) if row is not None and row.owner is not None else None

    async def steal(
        self, scope: Scope, seen_token: int, owner: str, lease_s: float
    ) -> Claim | None:
        row = self._owned(scope, seen_token)
        if row is None:
            return None
        row.owner, row.token, row.lease_until = owner, row.token + 1, time.time() + lease_s
        return Claim(row.token, row.epoch, row.open)

    async def renew(self, scope: Scope, token: int, lease_s: float) -> bool:
        row = self._owned(scope, token)
        if row is None or row.owner is None:
            return False
        row.lease_until = time.time() + lease_s
        return True

    async def begin_run(self, scope: Scope, token: int) -> bool:
        row = self._owned(scope, token)
        if row is None:
            return False
        row.open = True
        return True

    async def release(self, scope: Scope, token: int, advance_to: int | None) -> bool:
        row = self._owned(scope, token)
        if row is None:
            return False
        row.owner, row.lease_until, row.updated_at = None, 0.0, time.time()
        if advance_to is not None:
            row.epoch = max(row.epoch, advance_to)
            row.open = False
        return True

    async def load_run(self, scope: Scope, epoch: int) -> list[StoredEntry]:
        run = self.entries.get(scope.key, {}).get(epoch, {})
        return [entry for entry, _ in run.values()]

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
            and (existing[0].format, existing[0].value) == (replacing.format, replacing.value)
        )
        if existing is not None and not stale:
            return existing[0]
        if self._owned(scope, token) is None:
            return None
        self.idempotent[(scope.user_key, key)] = (entry, time.time())
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

    async def list_sessions(
        self, user_id: str | None, by_user: bool, limit: int, session_id: str | None = None
    ) -> list[SessionInfo]:
        infos = [
            SessionInfo(
                row.session_id,
                row.user_id,
                row.epoch,
                row.open,
                row.owner,
                row.updated_at,
                sum(len(run) for run in self.entries.get(key, {}).values()),
            )
            for key, row in self.sessions.items()
            if (not by_user or row.user_id == user_id)
            and (session_id is None or row.session_id == session_id)
        ]
        infos.sort(key=lambda i: i.updated_at, reverse=True)
        return infos[:limit]

    async def forget_sessions(self, user_id: str | None) -> int:
        now = time.time()
        gone = [
            key
            for key, row in self.sessions.items()
            if row.user_id == user_id
            and (row.owner is None or row.lease_until < now)
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
    ) -> int:
        cutoff = time.time() - older_than_s if older_than_s is not None else None
        doomed: list[tuple[dict[Any, Any], Any]] = []  # (container, key) of each row to drop
        for scope_key, runs in self.entries.items():
            row = self.sessions[scope_key]
            if (by_session and row.session_id != session_id) or (
                by_user and row.user_id != user_id
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
                if created < cutoff and (not by_user or key[0] == user_key)
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
            progress.advance(len(batch))
        progress.finish()
        return progress.done


class InMemoryRuntime(JournalRuntime):
    """A journal that lives as long as this object: replay within one process only."""

    def __init__(self, *, settings: Settings | None = None, **options: Any) -> None:
        super().__init__(InMemoryStore(), settings=settings, **options)

    def __repr__(self) -> str:
        return "InMemoryRuntime()"
