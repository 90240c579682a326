"""The checkpoint SQL, written once for SQLite and PostgreSQL.

A store built beside a runtime shares the runtime's :class:`~loomflow.storage.Database` (one
SQLite connection, or one asyncpg pool) and never closes it; a store built from a path, DSN
or URL owns its database. The table is migrated on first use (component ``checkpoints``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from .._ids import check_count, check_id, user_label
from .._printable import shown, text_of, unicode_column
from ..config import Settings
from ..errors import CheckpointError, OwnershipLostError, StoreUnavailableError
from ..messages import Usage
from ..runtime import codec
from ..runtime._store import Scope
from ..storage import PostgresDatabase, SqliteDatabase
from ..storage._component import ComponentStore
from ._types import (
    Checkpoint,
    UnreadableCheckpoint,
    check_writable,
    decode_payload,
    encode_payload,
    taken,
    timestamp,
)
from .inmemory import export_document
from .migrations import COMPONENT, MIGRATIONS

if TYPE_CHECKING:
    import asyncpg

__all__ = ["PostgresCheckpointStore", "SqlCheckpointStore", "SqliteCheckpointStore"]

_T = TypeVar("_T")

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
# The same insert, fenced as a journal step's write is (runtime/_sql.py _WRITE): it inserts
# only while the run's lease row still holds the writer's token, in the same statement, so a
# worker that lost its run between its lease check and this write stores nothing (PostgreSQL
# also locks the row FOR SHARE: a takeover waits for the write to commit). Typed casts: the
# values come from a SELECT, whose parameters PostgreSQL cannot type from the columns.
_INSERT_FENCED = """
INSERT INTO loom_checkpoints
    (checkpoint_id, scope, user_key, session_id, user_id, run_id, epoch, turn, final, prompt,
     output, prompt_index, tokens_in, tokens_out, cost_usd, parent_id, codec_version, messages,
     size, created_at)
SELECT CAST($1 AS TEXT), CAST($2 AS TEXT), CAST($3 AS TEXT), CAST($4 AS TEXT),
    CAST($5 AS TEXT), CAST($6 AS TEXT), CAST($7 AS BIGINT), CAST($8 AS INTEGER),
    CAST($9 AS SMALLINT), CAST($10 AS TEXT), CAST($11 AS TEXT), CAST($12 AS INTEGER),
    CAST($13 AS BIGINT), CAST($14 AS BIGINT), CAST($15 AS DOUBLE PRECISION), CAST($16 AS TEXT),
    CAST($17 AS INTEGER), $18, CAST($19 AS INTEGER), {now}
FROM loom_sessions WHERE scope = $2 AND token = $20{lock}
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
# The rows an erasure or an export covers: those under the user's key, and those that name
# the user but were moved under another key (edited in the database), which still hold the
# user's transcript (as memory's do). ``user_id = NULL`` matches nothing: the anonymous
# bucket is its key alone.
_OF_USER = "(user_key = $1 OR user_id = $2)"
_DELETE_USER = f"DELETE FROM loom_checkpoints WHERE {_OF_USER} RETURNING 1"
_EXPORT = f"SELECT {_COLUMNS} FROM loom_checkpoints WHERE {_OF_USER} ORDER BY seq"
_COUNT_USER = f"SELECT COUNT(*) FROM loom_checkpoints WHERE {_OF_USER}"


_ANY_SESSION = object()


def _row(row: Sequence[Any], user_id: str | None, session_id: Any = _ANY_SESSION) -> Checkpoint:
    """The checkpoint of a row read for ``user_id`` (and ``session_id``, unless any session).

    The query found the row by its scope or user key; its own session and user columns must
    say the same. A row moved under another user's key (edited in the database) would
    otherwise restore or export that user's transcript as this one's.
    """
    checkpoint = _checked(row)
    if checkpoint.user_id != user_id or (
        session_id is not _ANY_SESSION and checkpoint.session_id != session_id
    ):
        raise CheckpointError(
            f"checkpoint {shown(row[0])} is stored under session {shown(session_id)} of "
            f"{user_label(user_id)} but names session {shown(checkpoint.session_id)} of "
            f"{user_label(checkpoint.user_id)}: the row was moved (edited in the database)"
            if session_id is not _ANY_SESSION
            else f"checkpoint {shown(row[0])} is stored under {user_label(user_id)} but names "
            f"{user_label(checkpoint.user_id)}: the row was moved (edited in the database)"
        )
    return checkpoint


def _checked(row: Sequence[Any]) -> Checkpoint:
    try:
        return _checkpoint(row)
    except ValidationError as exc:  # a value no checkpoint holds (a negative prompt_index)
        cause: Exception = exc
        why = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
            for error in exc.errors()
        )
    except (TypeError, ValueError, ArithmeticError, OSError) as exc:
        # A row edited by hand (SQLite keeps any type in any column; a created_at of 1e300
        # fits PostgreSQL's double too) reads as damaged: resume falls back to replay.
        cause, why = exc, str(exc)
    raise CheckpointError(f"checkpoint {shown(row[0])} has a malformed column: {why}") from cause


def _readable(
    row: Sequence[Any], user_id: str | None, session_id: Any = _ANY_SESSION
) -> Checkpoint | UnreadableCheckpoint:
    """The checkpoint of a row, or, for a listing or an export, what can be read of it."""
    try:
        return _row(row, user_id, session_id)
    except CheckpointError as exc:
        return UnreadableCheckpoint(
            id=text_of(row[0]) or "",
            session_id=text_of(row[1]),
            user_id=text_of(row[2]),
            run_id=text_of(row[3]),
            unreadable=str(exc),
        )


def _column(name: str, convert: Callable[[Any], _T], value: Any) -> _T:
    """``convert(value)``, or a ValueError naming the column that holds what it refuses."""
    try:
        return convert(value)
    except (TypeError, ValueError, ArithmeticError, OSError) as exc:
        raise ValueError(f"{name} holds {shown(value)} ({exc})") from exc


# What each column must hold as read back: SQLite keeps any type in any column, so text, a
# blob or a fraction in a number column is refused here instead of being coerced (int(2.5),
# bool('no'), bytes(5)) into a snapshot nobody wrote.
def _integer(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"a {type(value).__name__}, not an integer")
    return value


def _flag(value: Any) -> bool:
    if type(value) is not int or value not in (0, 1):
        raise ValueError("not 0 or 1")
    return bool(value)


def _number(value: Any) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"a {type(value).__name__}, not a number")
    if not math.isfinite(value):
        # SQLite and PostgreSQL keep an infinity (1e999) or a NaN: no cost or time is one,
        # and it would come back as a run's cost and print as bare Infinity in JSON.
        raise ValueError("not a finite number")
    return float(value)


def _blob(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")  # SQLite text where the bytes belong
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"a {type(value).__name__}, not bytes")
    return bytes(value)


def _id_column(name: str, value: Any, *, optional: bool = False) -> Any:
    """An id column as read back; one that breaks the id rules (``put()`` refuses it: a NUL,
    300 bytes) is damage, not an id to restore and hand back as ``restored_from``."""
    return check_id(name, unicode_column(name, value), optional=optional)


def _checkpoint(row: Sequence[Any]) -> Checkpoint:
    (cid, session, user, run, epoch, turn, final, prompt, output, index) = row[:10]
    tokens_in, tokens_out, cost, parent, version, raw, created = row[10:]
    return Checkpoint(
        id=_id_column("checkpoint_id", cid),
        session_id=unicode_column("session_id", session),
        user_id=unicode_column("user_id", user),
        run_id=_id_column("run_id", run),
        epoch=_column("epoch", _integer, epoch),
        turn=_column("turn", _integer, turn),
        final=_column("final", _flag, final),
        # Text that is not UTF-8 (see storage/_sqlite.read_text) is damage like any other:
        # restored, it would reach a model call, and a fork would write it back, which fails.
        prompt=unicode_column("prompt", prompt),
        output=unicode_column("output", output),
        **decode_payload(
            _column("messages", _blob, raw), _column("codec_version", _integer, version), cid
        ),
        prompt_index=_column("prompt_index", _integer, index),
        usage=Usage(
            input_tokens=_column("tokens_in", _integer, tokens_in),
            output_tokens=_column("tokens_out", _integer, tokens_out),
        ),
        cost_usd=_column("cost_usd", _number, cost),
        parent_id=_id_column("parent_id", parent, optional=True),
        created_at=_column("created_at", lambda v: timestamp(_number(v)), created),
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

    async def put(
        self, checkpoint: Checkpoint, *, retention: int | None = None, token: int | None = None
    ) -> Checkpoint:
        """Store a snapshot (see :class:`CheckpointStore`).

        ``token`` fences the write on a run's lease, as the journal fences a step: the store
        must share the journal's database, and the snapshot is stored only while the run's
        lease row holds that token (otherwise :class:`~loomflow.errors.OwnershipLostError`,
        and nothing is written). Agents pass it; most callers leave it out.
        """
        scope = Scope.checked(checkpoint.session_id, checkpoint.user_id)
        check_writable(checkpoint)
        retention = check_count("retention", retention, 1)
        raw = encode_payload(checkpoint)
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
        try:
            async with self.db.transaction(what="checkpoint write") as tx:
                if token is None:
                    rows = await tx.fetch(_INSERT, *args)
                else:
                    rows = await tx.fetch(_INSERT_FENCED, *args, token)
                    if not rows:  # the lease row holds a newer token: nothing was written
                        raise OwnershipLostError(
                            f"checkpoint {checkpoint.id!r} was not written: session "
                            f"{checkpoint.session_id!r} of user {checkpoint.user_id!r} now "
                            "belongs to a newer run"
                        )
                if retention is not None:
                    await tx.execute(_RETAIN, scope.key, retention)
        except StoreUnavailableError as error:
            if self.db.is_duplicate_key(error):  # no outage: the id is taken
                raise taken(checkpoint.id) from error
            raise
        return checkpoint.model_copy(update={"created_at": timestamp(rows[0][0])})

    async def latest(self, session_id: str, *, user_id: str | None) -> Checkpoint | None:
        rows = await self._fetch("read", _LATEST, Scope.checked(session_id, user_id).key)
        return _row(rows[0], user_id, session_id) if rows else None

    async def get(
        self, checkpoint_id: str, *, session_id: str, user_id: str | None
    ) -> Checkpoint | None:
        key = Scope.checked(session_id, user_id).key
        # Refused by name, as from_checkpoint= is: a NUL or a lone surrogate was a
        # StoreUnavailableError on PostgreSQL (a database that is down, which callers retry).
        check_id("checkpoint_id", checkpoint_id, optional=False)
        rows = await self._fetch("read", _GET, key, checkpoint_id)
        return _row(rows[0], user_id, session_id) if rows else None

    async def list_checkpoints(
        self, session_id: str, *, user_id: str | None, limit: int | None = None
    ) -> list[Checkpoint]:
        return [_row(r, user_id, session_id) for r in await self._rows(session_id, user_id, limit)]

    async def _rows(
        self, session_id: str, user_id: str | None, limit: int | None
    ) -> Sequence[Sequence[Any]]:
        key = Scope.checked(session_id, user_id).key
        if check_count("limit", limit, 0) is None:
            return await self._fetch("read", _LIST, key)
        return await self._fetch("read", _LIST_LIMIT, key, limit)

    async def delete_session(self, session_id: str, *, user_id: str | None) -> int:
        key = Scope.checked(session_id, user_id).key
        return len(await self._fetch("delete", _DELETE_SCOPE, key))

    async def forget_user(self, user_id: str | None) -> int:
        user_key = Scope.checked(None, user_id).user_key
        return len(await self._fetch("delete", _DELETE_USER, user_key, user_id))

    async def count_user(self, user_id: str | None) -> int:
        """How many snapshots :meth:`forget_user` would delete."""
        user_key = Scope.checked(None, user_id).user_key
        return int((await self._fetch("read", _COUNT_USER, user_key, user_id))[0][0])

    async def listing(
        self, session_id: str, *, user_id: str | None, limit: int | None = None
    ) -> list[Checkpoint | UnreadableCheckpoint]:
        """:meth:`list_checkpoints` for people: a row that cannot be read back (edited by
        hand) is an :class:`UnreadableCheckpoint` saying why, instead of failing the list."""
        rows = await self._rows(session_id, user_id, limit)
        return [_readable(r, user_id, session_id) for r in rows]

    async def export_user(self, user_id: str | None) -> dict[str, Any]:
        user_key = Scope.checked(None, user_id).user_key
        rows = await self._fetch("read", _EXPORT, user_key, user_id)
        # A data-access export carries on past a damaged row, and shows it as damaged.
        return export_document(user_id, [_readable(r, user_id) for r in rows])


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
