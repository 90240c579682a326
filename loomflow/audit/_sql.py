"""The audit log's SQL, shared by the SQLite and PostgreSQL backends.

Appending a user's records is one transaction under a per-user lock (a PostgreSQL advisory
transaction lock keyed by the user; SQLite's database write lock): read the user's head, insert
the sealed entries; a trigger moves the head and refuses an entry that does not extend it.
``UNIQUE (user_key, seq)`` backs the lock up: a writer that somehow raced would fail rather
than fork the chain.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import ValidationError

from .._ids import user_label
from .._printable import shown
from ..errors import AuditIntegrityError, ErasureRefusedError, StoreUnavailableError
from ..storage import Database
from ..storage._component import SqlLifecycle
from ._entry import (
    GENESIS,
    AuditEntry,
    AuditRecord,
    canonical_json,
    read_stored_payload,
    unreadable_reason,
)
from ._store import (
    AuditFilter,
    AuditStore,
    ChainHead,
    ChainItem,
    ChainProblem,
    _user_of_key,
    malformed_head,
    names_trail,
)
from .actions import KEPT_BY_ERASURE
from .migrations import COMPONENT, migrations_for

__all__ = ["SqlAuditStore"]

_COLUMNS = (
    "id, user_id, seq, time_us, session_id, run_id, actor, action, payload, schema_version, "
    "prev_hash, hash, hash_version, payload_digest, payload_salt"
)
_INSERT_COLUMNS = (
    "(user_key, user_id, seq, time_us, session_id, run_id, actor, action, payload, "
    "schema_version, prev_hash, hash, hash_version, payload_digest, payload_salt)"
)
_ERASED = "null"  # the payload column of an erased entry
# Constants of our own, so spelled into the SQL rather than passed as parameters.
_KEPT = ", ".join(f"'{action}'" for action in KEPT_BY_ERASURE)
_HEAD = """
SELECT CAST({now} * 1000000 AS BIGINT), h.seq, h.hash
FROM (SELECT 1 AS one) AS clock LEFT JOIN loom_audit_heads h ON h.user_key = $1
"""
_LAST_SEQ = "SELECT MAX(seq) FROM loom_audit WHERE user_key = $1"
_PAGE = 1000
_HEX = frozenset("0123456789abcdef")


def _is_hash(value: object) -> bool:
    """Whether a stored hash is one an entry's sealing gives: 64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 64 and _HEX.issuperset(value)


def _user_of(records: Sequence[AuditRecord]) -> str:
    return user_label(records[0].user_id) if records else "this user"


def lock_key(key: str) -> int:
    """A signed 64-bit advisory-lock key per user (collisions only cost some waiting)."""
    digest = hashlib.sha256(b"loomflow-audit:" + key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _next_text(prefix: str) -> str | None:
    """The smallest text above every text starting with ``prefix`` in code point order
    (``None``: there is none, the prefix is all U+10FFFF), skipping the surrogates, which
    no stored text holds."""
    end = len(prefix)
    while end and prefix[end - 1] == "\U0010ffff":
        end -= 1
    if not end:
        return None
    following = ord(prefix[end - 1]) + 1
    return prefix[: end - 1] + chr(0xE000 if following == 0xD800 else following)


class SqlAuditStore(AuditStore):
    """Audit entries in the ``loom_audit`` table of a :class:`~loomflow.storage.Database`.

    Args:
        db: The database; pass a runtime's ``database`` to share its connection or pool.
        owns_db: Close ``db`` when the store closes (``False`` for a shared database).
        auto_migrate: Create or migrate the tables on first use.
    """

    def __init__(self, db: Database, *, owns_db: bool = True, auto_migrate: bool = True) -> None:
        self.db = db
        self.backend = db.backend
        self._owns_db = owns_db
        self._auto_migrate = auto_migrate
        self._life = SqlLifecycle(
            db,
            COMPONENT,
            migrations_for(db.dialect.name),
            owns_db=owns_db,
            auto_migrate=auto_migrate,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.db!r})"

    async def open(self) -> None:
        await self._life.ensure_open()

    async def _before_write(self) -> None:
        """Called before each append (PostgreSQL checks the role once): not on opening, so
        that reading the trail (query, export, verify) warns of nothing a reader can mend."""

    @property
    def ready(self) -> bool:
        """Whether the store is connected and migrated."""
        return self._life.ready

    async def migrate(self) -> int:
        """Apply pending audit migrations; returns the schema version now in place."""
        return await self._life.migrate()

    async def close(self) -> None:
        await self._life.close()

    async def _append_chain(self, key: str, records: Sequence[AuditRecord]) -> list[AuditEntry]:
        await self._before_write()
        async with self.db.transaction(lock_key=lock_key(key), what="audit append") as tx:
            now_us, seq, prev = (await tx.fetch(_HEAD, key))[0]
            if seq is None and prev is None:  # no head: the user's first entry, unless...
                last = await tx.fetch(_LAST_SEQ, key)
                if last and last[0][0] is not None:
                    raise AuditIntegrityError(
                        f"the audit trail of {_user_of(records)} has entries (up to seq "
                        f"{shown(last[0][0])}) but no chain head: its head row was deleted or "
                        "moved; appending would start a second chain (run `loomflow audit "
                        "verify`)"
                    )
                seq, prev = 0, GENESIS
            elif type(seq) is not int or seq < 1 or not _is_hash(prev):
                # A head row edited by hand: entries chained on it would hide the edit.
                raise AuditIntegrityError(
                    f"the audit chain head of {_user_of(records)} is malformed (seq "
                    f"{shown(seq)}, hash {shown(prev)}): nothing can be appended to it (run "
                    "`loomflow audit verify`)"
                )
            entries: list[AuditEntry] = []
            for record in records:
                seq += 1
                entry = AuditEntry.seal(record, seq=seq, time_us=int(now_us), prev_hash=prev)
                prev = entry.hash
                entries.append(entry)
            args: list[Any] = []
            rows = []
            for entry in entries:
                base = len(args)
                rows.append("(" + ", ".join(f"${base + i}" for i in range(1, 16)) + ")")
                args += [
                    key,
                    entry.user_id,
                    entry.seq,
                    entry.time_us,
                    entry.session_id,
                    entry.run_id,
                    entry.actor,
                    entry.action,
                    canonical_json(entry.payload),
                    entry.schema_version,
                    entry.prev_hash,
                    entry.hash,
                    entry.hash_version,
                    entry.payload_digest,
                    entry.payload_salt,
                ]
            # The insert trigger moves the head (audit schema version 2).
            await tx.execute(
                f"INSERT INTO loom_audit {_INSERT_COLUMNS} VALUES {', '.join(rows)}", *args
            )
        return entries

    async def _query(
        self, where: AuditFilter, limit: int, after: int | None
    ) -> tuple[list[AuditEntry | ChainProblem], int | None]:
        conds, args = _conditions(where, self.db.dialect.name == "sqlite")
        if after is not None:
            args.append(after)
            conds.append(f"id > ${len(args)}")
        args.append(limit)
        sql = (
            f"SELECT {_COLUMNS}, user_key FROM loom_audit{_where(conds)} "
            f"ORDER BY id LIMIT ${len(args)}"
        )
        rows = await self.db.fetch(sql, *args, what="audit query")
        found: list[AuditEntry | ChainProblem] = []
        for row in rows:
            try:
                found.append(_entry(row[:-1])[1])
            except AuditIntegrityError as exc:
                # One row edited into no entry (a text seq, bytes in a text column) must not
                # keep the rest of the trail from a query or an export: it is returned in its
                # place as what verify reports of it, for the caller to show as damaged.
                found.append(_malformed(str(row[-1]), row[:-1], str(exc)))
        return found, int(rows[-1][0]) if rows else None

    async def _count(self, where: AuditFilter) -> int:
        conds, args = _conditions(where, self.db.dialect.name == "sqlite")
        sql = f"SELECT COUNT(*) FROM loom_audit{_where(conds)}"
        return int((await self.db.fetch(sql, *args, what="audit count"))[0][0])

    async def _chain_items(self, only: str | None) -> AsyncIterator[ChainItem]:
        last_key, last_seq = "", 0
        while True:
            if only is not None:
                rows = await self.db.fetch(
                    f"SELECT user_key, {_COLUMNS} FROM loom_audit WHERE user_key = $1 "
                    "AND seq > $2 ORDER BY seq LIMIT $3",
                    only,
                    last_seq,
                    _PAGE,
                    what="audit verify",
                )
            else:
                rows = await self.db.fetch(
                    f"SELECT user_key, {_COLUMNS} FROM loom_audit "
                    "WHERE (user_key, seq) > ($1, $2) ORDER BY user_key, seq LIMIT $3",
                    last_key,
                    last_seq,
                    _PAGE,
                    what="audit verify",
                )
            for row in rows:
                key = str(row[0])
                try:
                    problem, entry = _entry(row[1:])
                except AuditIntegrityError as exc:
                    # A seq or time edited into no number (SQLite keeps any type): reported
                    # where it lies, and the check goes on with the rest of the trails.
                    yield key, int(row[1]), _malformed(key, row[1:], str(exc))
                    continue
                yield key, int(row[1]), problem if problem is not None else entry
            if len(rows) < _PAGE:
                return
            # As stored, not int(): a seq edited into text sorts after every number in SQLite,
            # and the next page starts past it all the same.
            last_key, last_seq = str(rows[-1][0]), rows[-1][3]

    async def _tombstone(
        self,
        key: str,
        below_seq: int,
        before_us: int | None,
        old_seqs: Sequence[int],
        *,
        sweep: bool = True,
    ) -> int:
        erase = f"UPDATE loom_audit SET payload = '{_ERASED}', payload_salt = NULL"
        live = f"user_key = $1 AND payload <> '{_ERASED}' AND action NOT IN ({_KEPT})"
        try:
            # Under the user's append lock, so no entry of theirs is written meanwhile.
            async with self.db.transaction(lock_key=lock_key(key), what="audit erasure") as tx:
                erased = 0
                if sweep:
                    args: list[Any] = [key, below_seq]
                    sql = f"{erase} WHERE {live} AND seq < $2 AND hash_version >= 3"
                    if before_us is not None:
                        args.append(before_us)
                        sql += " AND time_us < $3"
                    erased = len(await tx.fetch(sql + " RETURNING 1", *args))
                for at in range(0, len(old_seqs), 500):
                    chunk = [int(s) for s in old_seqs[at : at + 500] if int(s) < below_seq]
                    if not chunk:
                        continue
                    marks = ", ".join(f"${i}" for i in range(2, len(chunk) + 2))
                    found = await tx.fetch(
                        f"{erase} WHERE {live} AND seq IN ({marks}) RETURNING 1", key, *chunk
                    )
                    erased += len(found)
        except StoreUnavailableError as exc:
            if getattr(exc.__cause__, "sqlstate", None) == "42501":  # insufficient_privilege
                raise ErasureRefusedError(
                    f"the database role may not erase audit payloads ({exc.__cause__}): run "
                    "erasure as the role that owns the audit tables, not the application role"
                ) from exc
            raise
        return erased

    async def _payloads_before(self, before_us: int) -> list[tuple[str | None, int]]:
        rows = await self.db.fetch(
            "SELECT user_key, MIN(user_id), COUNT(*) FROM loom_audit "
            f"WHERE time_us < $1 AND payload <> '{_ERASED}' AND action NOT IN ({_KEPT}) "
            "GROUP BY user_key ORDER BY user_key",
            before_us,
            what="audit retention",
        )
        # The user whose trail the key is: a row's user_id column may have been edited, and
        # retention works on trails, by key, as verify and erasure do.
        return [(_user_of_key(str(r[0]), r[1]), int(r[2])) for r in rows]

    async def _heads(self, only: str | None) -> dict[str, ChainHead]:
        heads, malformed = await self._head_rows(only)
        if malformed:
            raise AuditIntegrityError(f"an audit head is malformed: {malformed[0][1]}")
        return heads

    async def _head_pages(
        self, size: int
    ) -> AsyncIterator[list[tuple[str, ChainHead | ChainProblem]]]:
        # Keyset paging over the heads' primary key: each page is one index range scan.
        select = "SELECT user_key, user_id, seq, hash FROM loom_audit_heads"
        after: Any = None
        while True:
            if after is None:
                rows = await self.db.fetch(
                    f"{select} ORDER BY user_key LIMIT $1", size, what="audit heads"
                )
            else:
                rows = await self.db.fetch(
                    f"{select} WHERE user_key > $1 ORDER BY user_key LIMIT $2",
                    after,
                    size,
                    what="audit heads",
                )
            # The rows' order, which is the database's collation of the keys.
            page = [self._read_head_row(r) for r in rows]
            if page:
                yield page
            if len(rows) < size:
                return
            # The key as stored: a blob put in by hand (SQLite sorts blobs after all text)
            # is the cursor of the blobs after it.
            if rows[-1][0] == after:  # a cursor that does not move: never read a page twice
                raise AuditIntegrityError("the audit heads do not sort by their keys")
            after = rows[-1][0]

    @staticmethod
    def _read_head_row(r: Sequence[Any]) -> tuple[str, ChainHead | ChainProblem]:
        """A head row with its trail key; for one that reads as no head, its problem."""
        if type(r[0]) is not str:  # SQLite keeps bytes in a TEXT key: it names no trail
            return str(r[0]), ChainProblem(
                None,
                "unreadable",
                None,
                None,
                f"a head row's user key is not text ({shown(r[0])}): the head was edited, and "
                "names no user's trail",
            )
        try:
            return r[0], _head_of(r)
        except (TypeError, ValueError) as exc:  # a head row edited by hand
            return r[0], _malformed_head_row(r[0], str(exc))

    async def _verify_source(
        self, only: str | None
    ) -> tuple[dict[str, ChainHead], AsyncIterator[ChainItem]]:
        # A head row edited by hand is a problem verify reports, with the trail it heads, not
        # an error that leaves every other trail unchecked. That trail is then walked as one
        # without a head.
        heads, malformed = await self._head_rows(only)
        problems = [_malformed_head_row(key, why) for key, why in malformed]
        return heads, _after(problems, self._chain_items(only))

    async def _head_rows(
        self, only: str | None
    ) -> tuple[dict[str, ChainHead], list[tuple[str, str]]]:
        """The heads that read as heads, and the keys of those that do not, with why."""
        if only is None:
            rows = await self.db.fetch(
                "SELECT user_key, user_id, seq, hash FROM loom_audit_heads", what="audit heads"
            )
        else:
            rows = await self.db.fetch(
                "SELECT user_key, user_id, seq, hash FROM loom_audit_heads WHERE user_key = $1",
                only,
                what="audit heads",
            )
        return self._read_head_rows(rows)

    @staticmethod
    def _read_head_rows(rows: Any) -> tuple[dict[str, ChainHead], list[tuple[str, str]]]:
        heads: dict[str, ChainHead] = {}
        malformed: list[tuple[str, str]] = []
        for r in rows:
            try:
                heads[str(r[0])] = _head_of(r)
            except (TypeError, ValueError) as exc:  # a head row edited by hand
                malformed.append((str(r[0]), str(exc)))
        return heads, malformed


async def _after(
    problems: list[ChainProblem], items: AsyncIterator[ChainItem]
) -> AsyncIterator[ChainItem]:
    """``problems`` (of no entry, reported as they are), then ``items``."""
    for problem in problems:
        yield "", -1, problem
    async for item in items:
        yield item


def _conditions(where: AuditFilter, code_point_order: bool) -> tuple[list[str], list[Any]]:
    """The SQL conditions of a filter, numbered ``$1..$n``, and their arguments;
    ``code_point_order``: whether the database compares text by code point (SQLite)."""
    args: list[Any] = []

    def param(value: Any) -> str:
        args.append(value)
        return f"${len(args)}"

    conds: list[str] = []
    if where.user_key is not None:
        conds.append(f"user_key = {param(where.user_key)}")
    if where.session_id is not None:
        conds.append(f"session_id = {param(where.session_id)}")
    if where.run_id is not None:
        conds.append(f"run_id = {param(where.run_id)}")
    if where.action is not None:
        conds.append(f"action = {param(where.action)}")
    if where.action_prefix:
        prefix = where.action_prefix
        # A family (``tool.*``) is the actions whose first characters are the prefix: an
        # equality, which holds under every collation. The text range is added only where
        # text sorts by code point (SQLite), for the index: PostgreSQL sorts by the
        # database's collation, where ``Tool.x`` may fall inside the range of ``tool.`` and
        # ``legal_hold.placed`` (punctuation passed over) outside that of ``legal_hold.``.
        conds.append(f"substr(action, 1, {len(prefix)}) = {param(prefix)}")
        if code_point_order:
            conds.append(f"action >= ${len(args)}")
            upper = _next_text(prefix)
            if upper is not None:
                conds.append(f"action < {param(upper)}")
    if where.since_us is not None:
        conds.append(f"time_us >= {param(where.since_us)}")
    if where.until_us is not None:
        conds.append(f"time_us < {param(where.until_us)}")
    if where.seq is not None:
        conds.append(f"seq = {param(where.seq)}")
    return conds, args


def _where(conds: list[str]) -> str:
    return f" WHERE {' AND '.join(conds)}" if conds else ""


def _entry(row: Sequence[Any]) -> tuple[ChainProblem | None, AuditEntry]:
    try:
        return _entry_of(row)
    except (TypeError, ValueError, ArithmeticError) as exc:
        # A row edited by hand (SQLite keeps any type in any column): a clear error for
        # query, export and verify alike, instead of a traceback.
        # A user column that is not text names nobody: the message does not make it a user.
        # Values quoted cut (``shown``): a crafted one may be any size, and the reason is shown
        # on pages, in exports' markers and verify reports.
        of = f" of user {shown(row[1])}" if row[1] is None or isinstance(row[1], str) else ""
        raise AuditIntegrityError(f"audit entry {row[0]!r}{of} is malformed: {exc}") from exc


def _malformed(key: str, row: Sequence[Any], detail: str) -> ChainProblem:
    """The problem a row that reads as no entry at all is, for verify: its seq, when that
    much is a whole number (so the chain counts it as present), else none. Filed under the
    row's user, or the user of the trail it is stored under when its user column is not
    text (SQLite keeps bytes in a TEXT column: ``str()`` of them is no user)."""
    seq = row[2] if type(row[2]) is int else None
    text = row[1] is None or isinstance(row[1], str)
    user = row[1] if text else _user_of_key(key, None)
    return ChainProblem(user, "unreadable", seq, int(row[0]), detail)


def _malformed_head_row(key: str, why: str) -> ChainProblem:
    """The problem of a head row that reads as no head: its trail's, or for a key that is no
    trail's (not the runs without a user, whose key is "null"), a row naming no user, as a
    blob key is, rather than one filed under the runs without a user."""
    if names_trail(key):
        return malformed_head(key, why)
    return ChainProblem(
        None,
        "unreadable",
        None,
        None,
        f"a head row's user key ({shown(key)}) names no user's trail, and the head is "
        f"malformed ({why}): the head was edited",
    )


def _head_of(row: Sequence[Any]) -> ChainHead:
    """A head row (key, user, seq, hash) as a head; TypeError or ValueError if it is none."""
    return ChainHead(_head_user(row[1]), _whole(row[2], "seq"), str(row[3]))


def _head_user(value: Any) -> str | None:
    """A head's user column as stored: SQLite keeps a number or bytes in a TEXT column, which
    no user id is (and no page could link to)."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"user_id is {value!r:.80}, not text")
    return value


def _whole(value: Any, column: str) -> int:
    """A number column as stored: SQLite keeps 12.5 or 'two' in an INTEGER column, and int()
    would read 12.5 as 12, an entry its writer never hashed."""
    if type(value) is not int:
        raise ValueError(f"{column} is {shown(value)}, not a whole number")
    return value


def _entry_of(row: Sequence[Any]) -> tuple[ChainProblem | None, AuditEntry]:
    (
        _id,
        user_id,
        seq,
        time_us,
        session_id,
        run_id,
        actor,
        action,
        payload,
        version,
        prev,
        hash_,
        hash_version,
        digest,
        salt,
    ) = row
    for column, value in zip(
        _TEXTS, (user_id, session_id, run_id, actor, action, prev, hash_, digest, salt), strict=True
    ):
        if value is not None and not isinstance(value, str):
            # SQLite keeps bytes in a TEXT column; pydantic would read UTF-8 bytes as the
            # text they spell, an entry no writer stored (and str() of others as a user).
            raise TypeError(f"{column} is stored as {type(value).__name__}, not text")
    seq = _whole(seq, "seq")
    version, hash_version = _whole(version, "schema_version"), _whole(hash_version, "hash_version")
    time_us = _whole(time_us, "time_us")
    problem = None
    try:
        # Strictly: a key given twice would be read here as its last value and by SQL's
        # json functions as its first; NaN or 1e400 would stop an export or a query --json.
        data = read_stored_payload(payload)
        if not isinstance(data, dict) and not (data is None and payload == _ERASED):
            raise ValueError("the payload is not a JSON object")
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        # Shown as-is in queries; verify reports it (its hash cannot match either).
        data = {"unreadable_payload": str(payload)}
        problem = ChainProblem(
            user_id,
            "unreadable",
            int(seq),
            int(_id),
            f"entry {seq} has an unreadable payload: {exc}",
        )
    fields: dict[str, Any] = {
        "schema_version": int(version),
        "hash_version": int(hash_version),
        "user_id": user_id,
        "seq": int(seq),
        "time_us": int(time_us),
        "session_id": session_id,
        "run_id": run_id,
        "actor": actor,
        "action": action,
        "payload": data,
        "payload_digest": digest,
        "payload_salt": salt,
        "prev_hash": prev,
        "hash": hash_,
    }
    try:
        entry = AuditEntry(**fields)
        # Marked, so that its exported line says so and verify --file reports it as verify
        # does (its hash or digest cannot match what is shown in place of the payload).
        return problem, entry if problem is None else entry.marked_unreadable(problem.detail)
    except ValidationError as exc:
        # A row edited into an entry no writer makes (a hash version relabelled, a digest
        # dropped, a number where text belongs): queries show it as stored, and verify
        # reports it in its place and goes on with the rest of the chain and the other users.
        why = unreadable_reason(exc)
        kept = {
            k: v if k in _NUMBERS or v is None or k == "payload" else str(v)
            for k, v in fields.items()
        }
        problem = ChainProblem(
            user_id if user_id is None else str(user_id),
            "unreadable",
            int(seq),
            int(_id),
            f"entry {seq} does not read as an audit entry: {why}",
        )
        return problem, AuditEntry.model_construct(set(kept), **kept).marked_unreadable(
            problem.detail
        )


_NUMBERS = ("schema_version", "hash_version", "seq", "time_us")
_TEXTS = (
    "user_id",
    "session_id",
    "run_id",
    "actor",
    "action",
    "prev_hash",
    "hash",
    "payload_digest",
    "payload_salt",
)
