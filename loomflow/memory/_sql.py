"""The memory SQL, written once for SQLite and PostgreSQL.

A store built beside a runtime shares the runtime's :class:`~loomflow.storage.Database` and
never closes it; one built from a path, DSN or URL owns its database. Tables are migrated on
first use (component ``memory``). Every statement filters on the user's key.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pydantic import ValidationError

from .._ids import user_label
from .._printable import shown, text_of, unicode_column
from ..errors import CorruptEntryError, OwnershipLostError
from ..runtime import codec
from ..runtime._store import Scope
from ..storage._component import ComponentStore
from ._types import (
    TICK,
    Block,
    Episode,
    Fact,
    UnreadableBlock,
    UnreadableEpisode,
    UnreadableFact,
    checked_name,
    decode_messages,
    encode_messages,
    episode_scope,
    micros,
    newest_within,
    timestamp,
    user_scope,
)
from .migrations import COMPONENT, MIGRATIONS

__all__ = ["SqlMemoryStore"]

_EPISODE_COLUMNS = (
    "episode_id, session_id, user_id, episode_key, run_id, epoch, output, codec_version, "
    "messages, created_at"
)
# A rewrite of a key replaces the episode's content; its id and creation time stay.
_ON_REWRITE = """
ON CONFLICT (user_key, episode_key) DO UPDATE SET
    run_id = excluded.run_id, epoch = excluded.epoch, output = excluded.output,
    codec_version = excluded.codec_version, messages = excluded.messages,
    updated_at = excluded.updated_at,
    -- A creation time no date can hold (a hand-edited row: NaN, infinity, text) is replaced
    -- with the rewrite's, or reading it back would fail the run that re-records the episode.
    created_at = CASE WHEN loom_memory_episodes.created_at BETWEEN 0 AND 253402300799
        THEN loom_memory_episodes.created_at ELSE excluded.created_at END
RETURNING episode_id, created_at
"""
_PUT_EPISODE = (
    """
INSERT INTO loom_memory_episodes
    (episode_id, user_key, scope, session_id, user_id, episode_key, run_id, epoch, output,
     codec_version, messages, created_at, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, {now}, {now})"""
    + _ON_REWRITE
)
# The same upsert, fenced as a snapshot's write is (checkpoints/_sql.py _INSERT_FENCED): it
# writes only while the run's lease row still holds the writer's token, in the same statement,
# so a worker frozen between its lease check and this write cannot replace the episode of the
# run's new owner (PostgreSQL also locks the row FOR SHARE: a takeover waits for the commit).
_PUT_EPISODE_FENCED = (
    """
INSERT INTO loom_memory_episodes
    (episode_id, user_key, scope, session_id, user_id, episode_key, run_id, epoch, output,
     codec_version, messages, created_at, updated_at)
SELECT CAST($1 AS TEXT), CAST($2 AS TEXT), CAST($3 AS TEXT), CAST($4 AS TEXT),
    CAST($5 AS TEXT), CAST($6 AS TEXT), CAST($7 AS TEXT), CAST($8 AS BIGINT), CAST($9 AS TEXT),
    CAST($10 AS INTEGER), $11, {now}, {now}
FROM loom_sessions WHERE scope = $3 AND token = $12{lock}
"""
    + _ON_REWRITE
)
_DELETE_EPISODES = "DELETE FROM loom_memory_episodes WHERE scope = $1 RETURNING 1"

_FACT_COLUMNS = (
    "fact_id, user_id, subject, predicate, object, valid_from, valid_to, superseded_by, source"
)
_CURRENT_FACT = f"""
SELECT {_FACT_COLUMNS} FROM loom_memory_facts
WHERE user_key = $1 AND subject = $2 AND predicate = $3 AND valid_to IS NULL
"""
# The current fact is closed by what selected it, not by the fact_id read back: a damaged
# row's id (text that is not UTF-8) cannot be bound, and the unique index makes it one row.
_CLOSE_FACT = """
UPDATE loom_memory_facts SET valid_to = $4, superseded_by = $5
WHERE user_key = $1 AND subject = $2 AND predicate = $3 AND valid_to IS NULL
"""
_INSERT_FACT = """
INSERT INTO loom_memory_facts
    (fact_id, user_key, user_id, subject, predicate, object, source, valid_from)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
"""

_BLOCK_COLUMNS = "user_id, name, content, created_at, updated_at"
_SET_BLOCK = f"""
INSERT INTO loom_memory_blocks (user_key, name, user_id, content, created_at, updated_at)
-- The clock read once: PostgreSQL's clock_timestamp() twice gave a new block an updated_at
-- microseconds after its created_at. (WHERE true: SQLite's parser then takes ON CONFLICT as
-- the upsert, not as a join's ON.)
SELECT $1, $2, $3, $4, clock.now, clock.now FROM (SELECT {{now}} AS now) AS clock WHERE true
ON CONFLICT (user_key, name) DO UPDATE SET
    user_id = excluded.user_id, content = excluded.content, updated_at = excluded.updated_at,
    -- As an episode's rewrite: a creation time no date can hold takes the write's, or the
    -- write would happen and then fail reading its own row back.
    created_at = CASE WHEN loom_memory_blocks.created_at BETWEEN 0 AND 253402300799
        THEN loom_memory_blocks.created_at ELSE excluded.created_at END
RETURNING {_BLOCK_COLUMNS}
"""
_GET_BLOCK = f"SELECT {_BLOCK_COLUMNS} FROM loom_memory_blocks WHERE user_key = $1 AND name = $2"
_BLOCKS = f"SELECT {_BLOCK_COLUMNS} FROM loom_memory_blocks WHERE user_key = $1"
_DELETE_BLOCK = "DELETE FROM loom_memory_blocks WHERE user_key = $1 AND name = $2 RETURNING 1"

_TABLES = {
    "episodes": "loom_memory_episodes",
    "facts": "loom_memory_facts",
    "blocks": "loom_memory_blocks",
}
# The rows an erasure or an export covers: those under the user's key, and those that name
# the user but were moved under another key (edited in the database), which still hold the
# user's data. ``user_id = NULL`` matches nothing, so the anonymous bucket is its key alone.
_OF_USER = "(user_key = $1 OR user_id = $2)"


def _why(exc: ValidationError) -> str:
    """A pydantic refusal in one line: which field, and why (no URL, no input repeated)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in exc.errors()
    )


_ANY_SESSION = object()


def _owned(what: str, row_user: object, user_id: str | None) -> None:
    """Refuse a row that names another user than the one whose key it is filed under.

    Every query finds rows by the user's key; a row moved under another user's key (edited
    in the database) would otherwise hand one user's memory to another, in a recall, a tool
    result or an export.
    """
    if row_user != user_id:
        named = user_label(row_user) if isinstance(row_user, str | None) else shown(row_user)
        raise CorruptEntryError(
            f"{what} is stored under {user_label(user_id)} but names {named}: the row was "
            "moved (edited in the database)"
        )


def _integer(column: str, value: Any) -> int:
    # SQLite keeps any type in any column: a fraction or a flag is not coerced into an epoch.
    if type(value) is not int:
        raise ValueError(f"{column} holds {shown(value)}, not an integer")
    return value


def _episode(row: Sequence[Any], user_id: str | None, session_id: Any = _ANY_SESSION) -> Episode:
    _owned(f"episode {shown(row[0])}", row[2], user_id)
    if session_id is not _ANY_SESSION and row[1] != session_id:
        raise CorruptEntryError(
            f"episode {shown(row[0])} is stored under session {shown(session_id)} but names "
            f"session {shown(row[1])}: the row was moved (edited in the database)"
        )
    try:
        return _episode_of(row)
    except ValidationError as exc:  # a value no episode holds (bytes that are no text)
        raise CorruptEntryError(
            f"episode {shown(row[0])} has a malformed column: {_why(exc)}"
        ) from exc
    except (TypeError, ValueError, ArithmeticError, OSError) as exc:
        # A row edited by hand (SQLite keeps any type in any column; a created_at of 1e300
        # fits PostgreSQL's double too) is damaged data, not a crash.
        raise CorruptEntryError(f"episode {shown(row[0])} has a malformed column: {exc}") from exc


def _episode_of(row: Sequence[Any]) -> Episode:
    eid, session, user, key, run, epoch, output, version, raw, created = row
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape")  # SQLite text where the bytes belong
    return Episode(
        id=unicode_column("episode_id", eid),
        session_id=unicode_column("session_id", session),
        user_id=unicode_column("user_id", user),
        key=unicode_column("episode_key", key),
        run_id=unicode_column("run_id", run),
        epoch=None if epoch is None else _integer("epoch", epoch),
        messages=decode_messages(bytes(raw), _integer("codec_version", version), eid),
        output=unicode_column("output", output),
        created_at=timestamp(created),
    )


def _fact(row: Sequence[Any], user_id: str | None) -> Fact:
    _owned(f"fact {shown(row[0])}", row[1], user_id)
    try:
        return _fact_of(row)
    except ValidationError as exc:
        why = _why(exc)
        raise CorruptEntryError(f"fact {shown(row[0])} has a malformed column: {why}") from exc
    except (TypeError, ValueError, ArithmeticError, OSError) as exc:  # as for an episode
        raise CorruptEntryError(f"fact {shown(row[0])} has a malformed column: {exc}") from exc


def _fact_of(row: Sequence[Any]) -> Fact:
    fid, user, subject, predicate, obj, start, end, superseded_by, source = row
    # Text that is not UTF-8 (bytes SQLite was handed by another tool, see
    # storage/_sqlite.read_text) is damage: recalled, it would reach a model call as a fact.
    return Fact(
        id=unicode_column("fact_id", fid),
        user_id=unicode_column("user_id", user),
        subject=unicode_column("subject", subject),
        predicate=unicode_column("predicate", predicate),
        object=unicode_column("object", obj),
        valid_from=timestamp(start),
        valid_to=None if end is None else timestamp(end),
        superseded_by=unicode_column("superseded_by", superseded_by),
        source=unicode_column("source", source),
    )


def _block(row: Sequence[Any], user_id: str | None) -> Block:
    _owned(f"block {shown(row[1])}", row[0], user_id)
    try:
        return _block_of(row)
    except ValidationError as exc:
        why = _why(exc)
        raise CorruptEntryError(f"block {shown(row[1])} has a malformed column: {why}") from exc
    except (TypeError, ValueError, ArithmeticError, OSError) as exc:  # as for an episode
        raise CorruptEntryError(f"block {shown(row[1])} has a malformed column: {exc}") from exc


def _block_of(row: Sequence[Any]) -> Block:
    user, name, content, created, updated = row
    return Block(
        user_id=unicode_column("user_id", user),
        name=unicode_column("name", name),
        content=unicode_column("content", content),
        created_at=timestamp(created),
        updated_at=timestamp(updated),
    )


# A user's export carries on past a damaged row and shows it as damaged, as the checkpoints'
# does: one hand-edited row must not cost a data-subject access request the whole document.


def _readable_episode(row: Sequence[Any], user_id: str | None) -> Episode | UnreadableEpisode:
    try:
        return _episode(row, user_id)
    except CorruptEntryError as exc:
        return UnreadableEpisode(
            id=text_of(row[0]) or "",
            session_id=text_of(row[1]),
            user_id=text_of(row[2]),
            key=text_of(row[3]),
            run_id=text_of(row[4]),
            unreadable=str(exc),
        )


def _readable_fact(row: Sequence[Any], user_id: str | None) -> Fact | UnreadableFact:
    try:
        return _fact(row, user_id)
    except CorruptEntryError as exc:
        return UnreadableFact(
            id=text_of(row[0]) or "",
            user_id=text_of(row[1]),
            subject=text_of(row[2]),
            predicate=text_of(row[3]),
            unreadable=str(exc),
        )


def _readable_block(row: Sequence[Any], user_id: str | None) -> Block | UnreadableBlock:
    try:
        return _block(row, user_id)
    except CorruptEntryError as exc:
        return UnreadableBlock(
            user_id=text_of(row[0]), name=text_of(row[1]) or "", unreadable=str(exc)
        )


_B = TypeVar("_B", Block, Block | UnreadableBlock)


def _by_name(blocks: list[_B]) -> list[_B]:
    # Sorted here, not by ORDER BY: PostgreSQL orders text by the database's collation (with
    # an en_US locale "a" before "B"), SQLite and the in-memory store by code point.
    return sorted(blocks, key=lambda b: b.name)


def _fact_lock(user_key: str, subject: str, predicate: str) -> int:
    # PostgreSQL advisory lock of one (user, subject, predicate): concurrent supersessions
    # queue instead of tripping the unique index. A CRC collision only serialises more.
    return zlib.crc32(json.dumps(["loomflow-fact", user_key, subject, predicate]).encode())


class SqlMemoryStore(ComponentStore):
    """A :class:`~loomflow.memory.MemoryStore` in a SQLite or PostgreSQL database.

    Args:
        db: The database (share a runtime's with ``owns_db=False``, the default).
        owns_db: Close ``db`` when the store is closed.
        auto_migrate: Create or upgrade the tables on first use (default: the
            ``LOOMFLOW_AUTO_MIGRATE`` setting).
    """

    component = COMPONENT
    migrations = MIGRATIONS

    # -- episodes ----------------------------------------------------------------------------

    async def put_episode(self, episode: Episode, *, token: int | None = None) -> Episode:
        """Store an episode (see :class:`~loomflow.memory.MemoryStore`).

        ``token`` fences the write on a run's lease, as a journal step's is: the store must
        share the journal's database, and the episode is written only while the run's lease
        row holds that token (otherwise :class:`~loomflow.errors.OwnershipLostError`, and
        nothing is written). Agents pass it; most callers leave it out.
        """
        scope = episode_scope(episode)
        args = (
            episode.id,
            scope.user_key,
            scope.key,
            episode.session_id,
            episode.user_id,
            episode.key,
            episode.run_id,
            episode.epoch,
            episode.output,
            codec.CODEC_VERSION,
            encode_messages(episode.messages),
        )
        if token is None:
            rows = await self._fetch("write", _PUT_EPISODE, *args)
        else:
            rows = await self._fetch("write", _PUT_EPISODE_FENCED, *args, token)
            if not rows:  # the lease row holds a newer token: nothing was written
                raise OwnershipLostError(
                    f"episode {episode.key!r} was not written: session {episode.session_id!r} "
                    f"of user {episode.user_id!r} now belongs to a newer run"
                )
        return episode.model_copy(update={"id": rows[0][0], "created_at": timestamp(rows[0][1])})

    async def episodes(
        self,
        session_id: str,
        user_id: str | None,
        *,
        before_epoch: int | None,
        limit: int | None,
        on_damaged: Callable[[CorruptEntryError], None] | None = None,
        max_bytes: int | None = None,
    ) -> list[Episode]:
        """As the protocol's; with ``on_damaged``, a damaged row is handed to it and left out
        instead of raised. With ``max_bytes``, see :func:`~._types.newest_within`: the
        messages of a row over the cap are not even read from the database."""
        scope = Scope.checked(session_id, user_id)
        # The user's key as well as the scope: what a run recalls is then always something
        # forget_user erases, even from a row whose user_key was edited away from its scope.
        args: list[Any] = [scope.key, scope.user_key]
        columns = _EPISODE_COLUMNS
        if max_bytes is not None:
            args.append(int(max_bytes))
            # length() of a blob is its bytes, on SQLite as on PostgreSQL (bytea).
            columns = columns.replace(
                "messages,", "CASE WHEN length(messages) > $3 THEN NULL ELSE messages END,"
            )
            columns += ", length(messages)"
        sql = f"SELECT {columns} FROM loom_memory_episodes WHERE scope = $1 AND user_key = $2"
        if before_epoch is not None:
            args.append(int(before_epoch))
            # Newest first so LIMIT keeps the most recent. `epoch <` leaves out NULL epochs,
            # so the order is the (scope, epoch) index's: a run's recall reads its last
            # episodes, not every episode of a long session sorted (143 ms at 30,000).
            sql += f" AND epoch < ${len(args)} ORDER BY epoch DESC, seq DESC"
        else:
            # COALESCE because PostgreSQL and SQLite disagree on where NULLs (runs without a
            # journal) sort.
            sql += " ORDER BY COALESCE(epoch, -1) DESC, seq DESC"
        if limit is not None:
            args.append(int(limit))
            sql += f" LIMIT ${len(args)}"
        rows = await self._fetch("read", sql, *args)
        if max_bytes is not None:
            rows = newest_within(
                rows, lambda r: (r[0], int(r[-1])), max_bytes, session_id, on_damaged
            )
        found = []
        for row in reversed(rows):
            try:
                # Without the size column a capped read adds at the end.
                plain = row if max_bytes is None else tuple(row)[:-1]
                found.append(_episode(plain, user_id, session_id))
            except CorruptEntryError as exc:
                if on_damaged is None:
                    raise
                on_damaged(exc)
        return found

    async def delete_episodes(self, session_id: str, user_id: str | None) -> int:
        key = Scope.checked(session_id, user_id).key
        return len(await self._fetch("delete", _DELETE_EPISODES, key))

    # -- facts -------------------------------------------------------------------------------

    async def remember(
        self,
        fact_id: str,
        user_id: str | None,
        subject: str,
        predicate: str,
        object: str,
        source: str | None,
    ) -> Fact:
        subject, predicate = checked_name("subject", subject), checked_name("predicate", predicate)
        user_key = user_scope(user_id).user_key
        await self.open()
        lock = _fact_lock(user_key, subject, predicate)
        async with self.db.transaction(lock_key=lock, what="memory write") as tx:
            now = micros((await tx.fetch("SELECT {now}"))[0][0])
            rows = await tx.fetch(_CURRENT_FACT, user_key, subject, predicate)
            start = now
            if rows:
                try:
                    current: Fact | None = _fact(rows[0], user_id)
                except CorruptEntryError:
                    # A damaged current version (edited by hand) is superseded from now: its
                    # own start may be no time at all (text, an overflow), and the new value
                    # is what the caller means to hold. It stays in the history as it is.
                    current = None
                if current is not None and current.object == object:
                    return current
                # Every version lasts at least one tick, even when the clock (SQLite's
                # counts milliseconds) did not move, or moved back, since the last one.
                if current is not None:
                    start = micros(max(now, float(rows[0][5]) + TICK))
                await tx.execute(_CLOSE_FACT, user_key, subject, predicate, start, fact_id)
            await tx.execute(
                _INSERT_FACT, fact_id, user_key, user_id, subject, predicate, object, source, start
            )
        return Fact(
            id=fact_id,
            user_id=user_id,
            subject=subject,
            predicate=predicate,
            object=object,
            valid_from=timestamp(start),
            source=source,
        )

    async def retract(self, user_id: str | None, subject: str, predicate: str) -> Fact | None:
        subject, predicate = checked_name("subject", subject), checked_name("predicate", predicate)
        user_key = user_scope(user_id).user_key
        await self.open()
        lock = _fact_lock(user_key, subject, predicate)
        async with self.db.transaction(lock_key=lock, what="memory write") as tx:
            rows = await tx.fetch(_CURRENT_FACT, user_key, subject, predicate)
            if not rows:
                return None
            retracted = _fact(rows[0], user_id)  # a damaged one is refused, before it is closed
            now = micros((await tx.fetch("SELECT {now}"))[0][0])
            end = micros(max(now, float(rows[0][5]) + TICK))
            await tx.execute(_CLOSE_FACT, user_key, subject, predicate, end, None)
        return retracted.model_copy(update={"valid_to": timestamp(end)})

    async def facts(
        self,
        user_id: str | None,
        *,
        subject: str | None,
        predicate: str | None,
        as_of: float | None,
        history: bool,
    ) -> list[Fact]:
        subject = None if subject is None else checked_name("subject", subject)
        predicate = None if predicate is None else checked_name("predicate", predicate)
        args: list[Any] = [user_scope(user_id).user_key]

        def param(value: Any) -> str:
            args.append(value)
            return f"${len(args)}"

        where = ["user_key = $1"]
        if subject is not None:
            where.append(f"subject = {param(subject)}")
        if predicate is not None:
            where.append(f"predicate = {param(predicate)}")
        if not history:
            if as_of is None:
                where.append("valid_to IS NULL")
            else:
                at = param(float(as_of))
                where.append(f"valid_from <= {at} AND (valid_to IS NULL OR valid_to > {at})")
        sql = (
            f"SELECT {_FACT_COLUMNS} FROM loom_memory_facts WHERE "
            + " AND ".join(where)
            + " ORDER BY seq"
        )
        return [_fact(r, user_id) for r in await self._fetch("read", sql, *args)]

    # -- blocks ------------------------------------------------------------------------------

    async def set_block(self, user_id: str | None, name: str, content: str) -> Block:
        name = checked_name("name", name)
        user_key = user_scope(user_id).user_key
        rows = await self._fetch("write", _SET_BLOCK, user_key, name, user_id, content)
        return _block(rows[0], user_id)

    async def get_block(self, user_id: str | None, name: str) -> Block | None:
        name = checked_name("name", name)
        rows = await self._fetch("read", _GET_BLOCK, user_scope(user_id).user_key, name)
        return _block(rows[0], user_id) if rows else None

    async def blocks(self, user_id: str | None) -> list[Block]:
        rows = await self._fetch("read", _BLOCKS, user_scope(user_id).user_key)
        return _by_name([_block(r, user_id) for r in rows])

    async def delete_block(self, user_id: str | None, name: str) -> bool:
        name = checked_name("name", name)
        user_key = user_scope(user_id).user_key
        return bool(await self._fetch("delete", _DELETE_BLOCK, user_key, name))

    # -- per user ----------------------------------------------------------------------------

    async def forget_user(self, user_id: str | None) -> dict[str, int]:
        user_key = user_scope(user_id).user_key
        await self.open()
        counts: dict[str, int] = {}
        # One transaction: a user is forgotten entirely or not at all.
        async with self.db.transaction(what="memory forget") as tx:
            for kind, table in _TABLES.items():
                rows = await tx.fetch(
                    f"DELETE FROM {table} WHERE {_OF_USER} RETURNING 1", user_key, user_id
                )
                counts[kind] = len(rows)
        return counts

    async def export_user(
        self, user_id: str | None
    ) -> tuple[
        list[Episode | UnreadableEpisode],
        list[Fact | UnreadableFact],
        list[Block | UnreadableBlock],
    ]:
        user_key = user_scope(user_id).user_key
        episodes = await self._fetch(
            "read",
            f"SELECT {_EPISODE_COLUMNS} FROM loom_memory_episodes WHERE {_OF_USER} ORDER BY seq",
            user_key,
            user_id,
        )
        facts = await self._fetch(
            "read",
            f"SELECT {_FACT_COLUMNS} FROM loom_memory_facts WHERE {_OF_USER} ORDER BY seq",
            user_key,
            user_id,
        )
        blocks = await self._fetch(
            "read",
            f"SELECT {_BLOCK_COLUMNS} FROM loom_memory_blocks WHERE {_OF_USER}",
            user_key,
            user_id,
        )
        return (
            [_readable_episode(r, user_id) for r in episodes],
            [_readable_fact(r, user_id) for r in facts],
            _by_name([_readable_block(r, user_id) for r in blocks]),
        )
