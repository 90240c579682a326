"""The checkpoint SQL, written once for SQLite and PostgreSQL.

A store built beside a runtime shares the runtime's :class:`~loomflow.storage.Database` (one
SQLite connection, or one asyncpg pool) and never closes it; a store built from a path, DSN
or URL owns its database. The table is migrated on first use (component ``checkpoints``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..config import Settings
from ..errors import CheckpointError
from ..messages import Usage
from ..runtime import codec
from ..runtime._store import Scope
from ..storage import PostgresDatabase, SqliteDatabase
from ..storage._component import ComponentStore
from ._types import Checkpoint, decode_messages, encode_messages, timestamp
from .inmemory import export_document
from .migrations import COMPONENT, MIGRATIONS

if TYPE_CHECKING:
    import asyncpg

__all__ = ["PostgresCheckpointStore", "SqlCheckpointStore", "SqliteCheckpointStore"]

_COLUMNS = (
    "checkpoint_id, session_id, user_id, run_id, epoch, turn, final, prompt, output, "
    "prompt_index, tokens_in, tokens_out, cost_usd, parent_id, codec_version, messages, "
    "created_at"
)
_INSERT = """
INSERT INTO loom_checkpoints
    (checkpoint_id, scope, user_key, session_id, user_id, run_id, epoch, turn, final, prompt,
     output, prompt_index, tokens_in, tokens_out, cost_usd, parent_id, codec_version, messages,
     size, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19,
    {now})
RETURNING created_at
"""
# Keep the newest N of a scope: everything at or below the seq of the (N+1)-th newest goes.
# When there are N or fewer, the subquery is NULL and the comparison deletes nothing.
_RETAIN = """
DELETE FROM loom_checkpoints WHERE scope = $1 AND seq <= (
    SELECT seq FROM loom_checkpoints WHERE scope = $1 ORDER BY seq DESC LIMIT 1 OFFSET $2
)
"""
_LATEST = f"SELECT {_COLUMNS} FROM loom_checkpoints WHERE scope = $1 ORDER BY seq DESC LIMIT 1"
_GET = f"SELECT {_COLUMNS} FROM loom_checkpoints WHERE scope = $1 AND checkpoint_id = $2"
_LIST = f"SELECT {_COLUMNS} FROM loom_checkpoints WHERE scope = $1 ORDER BY seq DESC"
_LIST_LIMIT = _LIST + " LIMIT $2"
_DELETE_SCOPE = "DELETE FROM loom_checkpoints WHERE scope = $1 RETURNING 1"
_DELETE_USER = "DELETE FROM loom_checkpoints WHERE user_key = $1 RETURNING 1"
_EXPORT = f"SELECT {_COLUMNS} FROM loom_checkpoints WHERE user_key = $1 ORDER BY seq"


def _row(row: Sequence[Any]) -> Checkpoint:
    try:
        return _checkpoint(row)
    except (TypeError, ValueError, ArithmeticError, OSError) as exc:
        # A row edited by hand (SQLite keeps any type in any column; a created_at of 1e300
        # fits PostgreSQL's double too) reads as damaged: resume falls back to replay.
        raise CheckpointError(f"checkpoint {row[0]!r} has a malformed column: {exc}") from exc


def _checkpoint(row: Sequence[Any]) -> Checkpoint:
    (cid, session, user, run, epoch, turn, final, prompt, output, index) = row[:10]
    tokens_in, tokens_out, cost, parent, version, raw, created = row[10:]
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape")  # SQLite text where the bytes belong
    return Checkpoint(
        id=cid,
        session_id=session,
        user_id=user,
        run_id=run,
        epoch=int(epoch),
        turn=int(turn),
        final=bool(final),
        prompt=prompt,
        output=output,
        messages=decode_messages(bytes(raw), int(version), cid),
        prompt_index=int(index),
        usage=Usage(input_tokens=int(tokens_in), output_tokens=int(tokens_out)),
        cost_usd=float(cost),
        parent_id=parent,
        created_at=timestamp(created),
    )


class SqlCheckpointStore(ComponentStore):
    """Checkpoints in a SQLite or PostgreSQL :class:`~loomflow.storage.Database`.

    Args:
        db: The database; share a runtime's with ``SqlCheckpointStore(runtime.database,
            owns_db=False)`` (or simply :func:`~loomflow.checkpoints.checkpoint_store_for`).
        owns_db: Close ``db`` when the store is closed.
        auto_migrate: Create or upgrade the table on first use (default: the
            ``LOOMFLOW_AUTO_MIGRATE`` setting).
    """

    component = COMPONENT
    migrations = MIGRATIONS

    async def put(self, checkpoint: Checkpoint, *, retention: int | None = None) -> Checkpoint:
        scope = Scope.checked(checkpoint.session_id, checkpoint.user_id)
        raw = encode_messages(checkpoint.messages)
        args = (
            checkpoint.id,
            scope.key,
            scope.user_key,
            checkpoint.session_id,
            checkpoint.user_id,
            checkpoint.run_id,
            checkpoint.epoch,
            checkpoint.turn,
            int(checkpoint.final),
            checkpoint.prompt,
            checkpoint.output,
            checkpoint.prompt_index,
            checkpoint.usage.input_tokens,
            checkpoint.usage.output_tokens,
            float(checkpoint.cost_usd),
            checkpoint.parent_id,
            codec.CODEC_VERSION,
            raw,
            len(raw),
        )
        await self.open()
        # The insert and the retention cut commit together: a reader never sees more than
        # the retained number, and a crash between them cannot leave the cut undone.
        async with self.db.transaction(what="checkpoint write") as tx:
            rows = await tx.fetch(_INSERT, *args)
            if retention is not None:
                await tx.execute(_RETAIN, scope.key, int(retention))
        return checkpoint.model_copy(update={"created_at": timestamp(rows[0][0])})

    async def latest(self, session_id: str, *, user_id: str | None) -> Checkpoint | None:
        rows = await self._fetch("read", _LATEST, Scope.checked(session_id, user_id).key)
        return _row(rows[0]) if rows else None

    async def get(
        self, checkpoint_id: str, *, session_id: str, user_id: str | None
    ) -> Checkpoint | None:
        key = Scope.checked(session_id, user_id).key
        rows = await self._fetch("read", _GET, key, checkpoint_id)
        return _row(rows[0]) if rows else None

    async def list_checkpoints(
        self, session_id: str, *, user_id: str | None, limit: int | None = None
    ) -> list[Checkpoint]:
        key = Scope.checked(session_id, user_id).key
        if limit is None:
            rows = await self._fetch("read", _LIST, key)
        else:
            rows = await self._fetch("read", _LIST_LIMIT, key, int(limit))
        return [_row(r) for r in rows]

    async def delete_session(self, session_id: str, *, user_id: str | None) -> int:
        key = Scope.checked(session_id, user_id).key
        return len(await self._fetch("delete", _DELETE_SCOPE, key))

    async def forget_user(self, user_id: str | None) -> int:
        user_key = Scope.checked(None, user_id).user_key
        return len(await self._fetch("delete", _DELETE_USER, user_key))

    async def export_user(self, user_id: str | None) -> dict[str, Any]:
        user_key = Scope.checked(None, user_id).user_key
        rows = await self._fetch("read", _EXPORT, user_key)
        return export_document(user_id, [_row(r) for r in rows])


class SqliteCheckpointStore(SqlCheckpointStore):
    """Checkpoints in a SQLite file: a path (owned) or a runtime's ``SqliteDatabase`` (shared).

    Example:
        >>> store = SqliteCheckpointStore(runtime.database)  # the journal's connection
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | SqliteDatabase,
        *,
        auto_migrate: bool | None = None,
        settings: Settings | None = None,
    ) -> None:
        if isinstance(target, SqliteDatabase):
            super().__init__(target, auto_migrate=auto_migrate, settings=settings)
            return
        s = settings or Settings()
        db = SqliteDatabase.from_settings(target, s)
        super().__init__(db, owns_db=True, auto_migrate=auto_migrate, settings=s)


class PostgresCheckpointStore(SqlCheckpointStore):
    """Checkpoints in PostgreSQL: a DSN or pool, or a runtime's ``PostgresDatabase`` (shared).

    A DSN makes a pool the store owns and closes; an adopted pool stays the caller's.
    """

    def __init__(
        self,
        target: str | asyncpg.Pool | PostgresDatabase,
        *,
        auto_migrate: bool | None = None,
        settings: Settings | None = None,
    ) -> None:
        if isinstance(target, PostgresDatabase):
            super().__init__(target, auto_migrate=auto_migrate, settings=settings)
            return
        super().__init__(
            PostgresDatabase(target),  # which closes only a pool it created itself
            owns_db=True,
            auto_migrate=auto_migrate,
            settings=settings,
        )
