"""Checkpoints in process memory, beside an :class:`~loomflow.runtime.InMemoryRuntime`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .._ids import check_count, check_id
from ..runtime._store import Scope
from ._types import Checkpoint, UnreadableCheckpoint, check_writable, taken, timestamp

__all__ = ["InMemoryCheckpointStore"]


def export_document(
    user_id: str | None, checkpoints: Sequence[Checkpoint | UnreadableCheckpoint]
) -> dict[str, Any]:
    """The JSON-ready form of a user's checkpoints, shared by every backend. A row that
    cannot be read back is in it too, as the damage it is (its ``unreadable`` reason)."""
    return {
        "user_id": user_id,
        "checkpoints": [c.model_dump(mode="json") for c in checkpoints],
    }


class InMemoryCheckpointStore:
    """Snapshots kept in a dict for as long as this object lives (tests, demos)."""

    backend = "memory"

    def __init__(self) -> None:
        # scope key -> [(seq, checkpoint)], oldest first; seq orders "newest" exactly.
        self._rows: dict[str, list[tuple[int, Checkpoint]]] = {}
        self._users: dict[str, str] = {}  # scope key -> user key
        # Every stored id: unique across sessions and users, as the SQL stores' column is.
        self._ids: set[str] = set()
        self._seq = 0

    def __repr__(self) -> str:
        return "InMemoryCheckpointStore()"

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def migrate(self) -> int:
        return 0

    async def put(self, checkpoint: Checkpoint, *, retention: int | None = None) -> Checkpoint:
        scope = Scope.checked(checkpoint.session_id, checkpoint.user_id)
        check_writable(checkpoint)
        retention = check_count("retention", retention, 1)
        if checkpoint.id in self._ids:
            raise taken(checkpoint.id)
        # Copies in and out: the transcript's lists and argument dicts stay the store's, as
        # a SQL row is (a caller's change to them changed the stored snapshot).
        stored = checkpoint.model_copy(update={"created_at": timestamp(time.time())}, deep=True)
        self._seq += 1
        rows = self._rows.setdefault(scope.key, [])
        rows.append((self._seq, stored))
        self._ids.add(stored.id)
        self._users[scope.key] = scope.user_key
        if retention is not None and len(rows) > retention:
            self._drop(rows[: len(rows) - retention])
            del rows[: len(rows) - retention]
        return _copy(stored)

    def _drop(self, rows: list[tuple[int, Checkpoint]]) -> int:
        self._ids.difference_update(c.id for _, c in rows)
        return len(rows)

    async def latest(self, session_id: str, *, user_id: str | None) -> Checkpoint | None:
        rows = self._rows.get(Scope.checked(session_id, user_id).key)
        return _copy(rows[-1][1]) if rows else None

    async def get(
        self, checkpoint_id: str, *, session_id: str, user_id: str | None
    ) -> Checkpoint | None:
        scope = Scope.checked(session_id, user_id)
        check_id("checkpoint_id", checkpoint_id, optional=False)  # as the SQL stores do
        for _, checkpoint in self._rows.get(scope.key, []):
            if checkpoint.id == checkpoint_id:
                return _copy(checkpoint)
        return None

    async def list_checkpoints(
        self, session_id: str, *, user_id: str | None, limit: int | None = None
    ) -> list[Checkpoint]:
        rows = self._rows.get(Scope.checked(session_id, user_id).key, [])
        limit = check_count("limit", limit, 0)
        newest = [c for _, c in reversed(rows)]
        return [_copy(c) for c in (newest if limit is None else newest[:limit])]

    async def listing(
        self, session_id: str, *, user_id: str | None, limit: int | None = None
    ) -> list[Checkpoint | UnreadableCheckpoint]:
        """:meth:`list_checkpoints` for people; nothing here is ever unreadable."""
        return list(await self.list_checkpoints(session_id, user_id=user_id, limit=limit))

    async def delete_session(self, session_id: str, *, user_id: str | None) -> int:
        return self._drop(self._rows.pop(Scope.checked(session_id, user_id).key, []))

    async def forget_user(self, user_id: str | None) -> int:
        user_key = Scope.checked(None, user_id).user_key
        deleted = 0
        for key in [k for k, u in self._users.items() if u == user_key]:
            deleted += self._drop(self._rows.pop(key, []))
            del self._users[key]
        return deleted

    async def count_user(self, user_id: str | None) -> int:
        """How many snapshots :meth:`forget_user` would delete."""
        user_key = Scope.checked(None, user_id).user_key
        return sum(len(self._rows.get(k, [])) for k, u in self._users.items() if u == user_key)

    async def export_user(self, user_id: str | None) -> dict[str, Any]:
        user_key = Scope.checked(None, user_id).user_key
        rows = [
            row
            for key, user in self._users.items()
            if user == user_key
            for row in self._rows.get(key, [])
        ]
        return export_document(user_id, [c for _, c in sorted(rows, key=lambda r: r[0])])


def _copy(checkpoint: Checkpoint) -> Checkpoint:
    return checkpoint.model_copy(deep=True)
