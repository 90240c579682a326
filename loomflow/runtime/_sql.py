"""The journal's SQL, shared by the SQLite and PostgreSQL backends.

Statements are written once with ``$n`` placeholders and ``{now}``/``{lock}`` hooks (see
:class:`loomflow.storage.Dialect`). Times come from the database clock so that leases
compare correctly across hosts. Every write uses ``RETURNING`` so that one round trip both
commits and tells whether the fenced write happened.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._printable import is_unicode, shown
from .._progress import OnProgress, Progress
from ..errors import CorruptEntryError, UserError
from ..storage import Database
from ..storage._component import SqlLifecycle
from . import _lease
from ._legacy import report_on_open
from ._states import FINAL_STATUSES, UNREADABLE, run_state
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
    key_damage,
    scope_session,
)
from .migrations import COMPONENT, MIGRATIONS

__all__ = ["SqlJournalStore"]


_LAST_NUMBER = 2**63 - 1  # an epoch or token here could not grow by one (BIGINT, INTEGER)
# Past any position a run can reach (its entries are all held in memory), and far enough below
# the top of PostgreSQL's INTEGER seq column that the positions after it still fit.
_SEQ_LIMIT = 2**30


def _bumped(column: str) -> str:
    """``column + 1``, except for a value no run reaches, which is left as it is for the
    claim to report the row as damaged. A token SQLite holds as text (a hand-edited row)
    would silently become 1 ('tok' + 1), the crashed owner's number; text never equals
    itself plus 0. One at the top of BIGINT would make PostgreSQL fail the statement
    ("bigint out of range") as if the database were down."""
    return (
        f"CASE WHEN {column} = {column} + 0 AND {column} < {_LAST_NUMBER} THEN {column} + 1 "
        f"ELSE {column} END"
    )


# A takeover adds one to the token (see _bumped for the rows it leaves alone).
_ACQUIRE = (
    """
INSERT INTO loom_sessions
    (scope, session_id, user_id, epoch, open, owner, token, lease_until, updated_at)
VALUES ($1, $2, $3, 0, 0, $4, 1, {now} + $5, {now})
ON CONFLICT (scope) DO UPDATE SET
    owner = excluded.owner,
    token = """
    + _bumped("loom_sessions.token")
    + """,
    lease_until = excluded.lease_until,
    updated_at = excluded.updated_at
WHERE loom_sessions.owner IS NULL OR loom_sessions.lease_until < {now}
RETURNING token, epoch, open, status
"""
)
# A new run in one commit: the turn is taken and the run opened (as _BEGIN does) only where
# the session has no open run to continue; otherwise nothing changes and the caller claims
# with _ACQUIRE.
_ACQUIRE_NEW = (
    """
INSERT INTO loom_sessions
    (scope, session_id, user_id, epoch, open, owner, token, lease_until, updated_at, agent,
     config, record, status, attempts, last_error, retry_at, created_at)
VALUES ($1, $2, $3, 0, 1, $4, 1, {now} + $5, {now}, $6, $7, $8, NULL, 0, NULL, 0, {now})
ON CONFLICT (scope) DO UPDATE SET
    owner = excluded.owner,
    token = """
    + _bumped("loom_sessions.token")
    + """,
    lease_until = excluded.lease_until,
    updated_at = excluded.updated_at,
    open = 1, agent = excluded.agent, config = excluded.config, record = excluded.record,
    status = NULL, attempts = 0, last_error = NULL, retry_at = 0,
    created_at = excluded.created_at
WHERE (loom_sessions.owner IS NULL OR loom_sessions.lease_until < {now})
    AND loom_sessions.open = 0
RETURNING token, epoch, open, status
"""
)
# A fork's session: claimed and opened only if the user has no row there yet, in one write, so
# that of two processes forking into one new session id one gets it and the other nothing.
_CREATE_NEW = """
INSERT INTO loom_sessions
    (scope, session_id, user_id, epoch, open, owner, token, lease_until, updated_at, agent,
     config, record, status, attempts, last_error, retry_at, created_at)
VALUES ($1, $2, $3, 0, 1, $4, 1, {now} + $5, {now}, $6, $7, $8, NULL, 0, NULL, 0, {now})
ON CONFLICT (scope) DO NOTHING
RETURNING token, epoch, open, status
"""
# Read only when the claim did not get the turn, so it may read the whole row: a holder whose
# row no claim writes (text in lease_until never compares below the clock) would otherwise be
# waited for until the turn timeout, then blamed as busy.
_HOLDER = """
SELECT owner, token, epoch, open, lease_until FROM loom_sessions
WHERE scope = $1 AND owner IS NOT NULL
"""
_STEAL = (
    """
UPDATE loom_sessions SET owner = $2,
    token = """
    + _bumped("token")
    + """,
    lease_until = {now} + $4, updated_at = {now}
WHERE scope = $1 AND token = $3
RETURNING token, epoch, open, status
"""
)
_RENEW = """
UPDATE loom_sessions SET lease_until = {now} + $3
WHERE scope = $1 AND token = $2 AND owner IS NOT NULL RETURNING token
"""
# A new run: its record (or none) replaces the last run's, and it starts with a clean slate.
_BEGIN = """
UPDATE loom_sessions SET open = 1, agent = $3, config = $4, record = $5, status = NULL,
    attempts = 0, last_error = NULL, retry_at = 0, created_at = {now}
WHERE scope = $1 AND token = $2 RETURNING token
"""
# A closed run that a resume goes on with, opened again at its own epoch by the holder of the
# turn (see JournalRuntime._reopen); its record stays the run's, and recovery counts afresh.
_REOPEN = """
UPDATE loom_sessions SET open = 1, epoch = $3, status = NULL, attempts = 0, last_error = NULL,
    retry_at = 0, updated_at = {now}
WHERE scope = $1 AND token = $2 AND owner IS NOT NULL AND open = 0 AND epoch = $3 + 1
    AND (status IS NULL OR status = 'interrupted')
RETURNING token
"""
_RELEASE_ADVANCE = """
UPDATE loom_sessions SET owner = NULL, lease_until = 0, open = 0, updated_at = {now},
    epoch = CASE WHEN epoch < $3 THEN $3 ELSE epoch END, status = $4
WHERE scope = $1 AND token = $2 RETURNING token
"""
_STATUS = "SELECT status FROM loom_sessions WHERE scope = $1"
_RECORD = "SELECT record FROM loom_sessions WHERE scope = $1"
# Cancel closes the run and bumps the token in one statement: the next fenced write (or lease
# renewal) of whoever runs it fails, and that run then reads the status to say why. An
# interrupted run (waiting for approval, say) is closed already: its epoch moved on when it
# stopped, so only its status changes, and a resume of it is refused from then on.
_CANCEL = (
    """
UPDATE loom_sessions SET status = 'cancelled', owner = NULL, lease_until = 0, open = 0,
    token = """
    + _bumped("token")
    + """,
    epoch = CASE WHEN open = 1 AND epoch < """
    + str(_LAST_NUMBER)
    + """ THEN epoch + 1
        ELSE epoch END,
    updated_at = {now}
WHERE scope = $1 AND (
    (open = 1 AND (status IS NULL OR status = 'failed')) OR (open = 0 AND status = 'interrupted')
) RETURNING token
"""
)
# Open runs a sweep looks at (served by the partial index on open runs): an owner whose lease
# may have run out, or a failed recovery attempt whose retry is due. A retry_at no backoff
# writes (text in SQLite, infinity or NaN, a century away: a hand-edited row) counts as due,
# or the run would never be retried and no sweep would say so; the claim rewrites it.
_OPEN_RUNS = """
SELECT session_id, user_id, owner, token, lease_until, {now}, attempts, retry_at, agent,
    config, record, scope, last_error
FROM loom_sessions
WHERE open = 1 AND status IS NULL
    AND (retry_at <= {now} OR NOT (retry_at < {now} + 3153600000))
    AND (owner IS NOT NULL OR attempts > 0)
ORDER BY {prefer}CASE WHEN owner IS NULL OR lease_until < {now} THEN 0 ELSE 1 END, retry_at,
    updated_at
LIMIT $1
"""
# Compare-and-set on the token: of two recoverers that saw the same orphan, one wins. A lease
# renewed since it was read (a slow owner, not a dead one) keeps the run with its owner. An
# attempt count no claim wrote (negative or text: a hand-edited row) starts again at 1: counted
# up from below zero, the run went unretried and never reached the dead-letter limit.
_CLAIM_ORPHAN = (
    """
UPDATE loom_sessions SET owner = $2,
    token = """
    + _bumped("token")
    + """,
    lease_until = {now} + $4,
    attempts = CASE WHEN attempts = attempts + 0 AND attempts >= 0 THEN attempts + 1 ELSE 1 END,
    retry_at = {now} + $5, updated_at = {now}
WHERE scope = $1 AND token = $3 AND open = 1 AND status IS NULL
    AND (owner IS NULL OR lease_until < {now} OR CAST($6 AS INTEGER) = 1)
RETURNING token, attempts
"""
)
_DEAD_LETTER_SEEN = (
    """
UPDATE loom_sessions SET status = 'failed', owner = NULL, lease_until = 0, last_error = $3,
    token = """
    + _bumped("token")
    + """,
    updated_at = {now}
WHERE scope = $1 AND token = $2 AND open = 1 AND status IS NULL RETURNING 1
"""
)
_DEAD_LETTER_FREE = """
UPDATE loom_sessions SET status = 'failed', last_error = $2, updated_at = {now}
WHERE scope = $1 AND owner IS NULL AND open = 1 AND status IS NULL RETURNING 1
"""
# A run handed back by a stopping worker (SIGTERM) gets the attempt of that claim back: it did
# not fail, and a run resumed through a few rolling deploys used to be given up as a dead
# letter for them. Not below 1: a run no recovery has touched lists as ``open``, not orphaned,
# and no sweep would find it again.
_REQUEUE = """
UPDATE loom_sessions SET retry_at = 0,
    attempts = CASE WHEN attempts = attempts + 0 AND attempts > 1 THEN attempts - 1
        ELSE attempts END
WHERE scope = $1 AND owner IS NULL AND open = 1 AND status IS NULL RETURNING 1
"""
_NOTE_ERROR = """
UPDATE loom_sessions SET last_error = $2
WHERE scope = $1 AND owner IS NULL AND open = 1 AND status IS NULL RETURNING 1
"""
# A token and an epoch that some release could have written: whole numbers (``x = x + 0``
# is false for the text or blob SQLite keeps in a number column) from 0 to below the top.
_SOUND = (
    f"(token = token + 0 AND token >= 0 AND token < {_LAST_NUMBER} "
    f"AND epoch = epoch + 0 AND epoch >= 0 AND epoch < {_LAST_NUMBER})"
)
# Finished runs are counted by the database; the few rows with an owner, an open run, a
# final status or a damaged token or epoch are read so their state can be worked out
# (liveness is checked here), as ``runs list`` works it out for each row.
_COUNT_CLOSED = f"""
SELECT status, COUNT(*) FROM loom_sessions WHERE open = 0 AND owner IS NULL AND {_SOUND}
GROUP BY status
"""
# ``open <> 0``, not ``open = 1``: a row holding a value no release writes ('yes', 2) is
# counted (as unreadable) instead of falling between the two statements.
_STATE_ROWS = f"""
SELECT open, owner, lease_until, {{now}}, status, attempts, token, epoch FROM loom_sessions
WHERE open <> 0 OR owner IS NOT NULL OR NOT {_SOUND}
"""
_RELEASE_KEEP = """
UPDATE loom_sessions SET owner = NULL, lease_until = 0, updated_at = {now}
WHERE scope = $1 AND token = $2 RETURNING token
"""
# Rows of the scope whose epoch is not a number belong to no run: a load by epoch never saw
# them, so their steps ran again without a word. SQLite sorts TEXT and BLOB after every
# INTEGER (and the column's affinity keeps a number a number), so the range past the largest
# INTEGER holds exactly them and is read from the primary key index like the run itself: a
# sound journal pays one empty index probe. On PostgreSQL the column is BIGINT: always empty.
_NO_RUN = f"e.epoch > {_LAST_NUMBER}"
_LOAD_RUN = f"""
SELECT e.path, e.name, e.fingerprint, e.kind, e.format, e.codec_version, e.value, e.seq, e.epoch
FROM loom_entries e WHERE e.scope = $1 AND e.epoch = $2
UNION ALL
SELECT e.path, e.name, e.fingerprint, e.kind, e.format, e.codec_version, e.value, e.seq, e.epoch
FROM loom_entries e WHERE e.scope = $1 AND {_NO_RUN}
"""
# A resume of a closed run reads the lease row and that run's entries in one statement (one
# snapshot on either database), and writes nothing unless a step has to run. The row's
# columns repeat on every entry; a run with no entries still gives the row (LEFT JOIN). The
# second part adds the scope's rows that belong to no run (see _NO_RUN), lease row and all.
_PEEK_COLUMNS = """SELECT s.token, s.epoch, s.open, s.status, s.owner, e.scope,
    e.path, e.name, e.fingerprint, e.kind, e.format, e.codec_version, e.value, e.seq, e.epoch
FROM loom_sessions s"""
_PEEK = f"""
{_PEEK_COLUMNS}
LEFT JOIN loom_entries e ON e.scope = s.scope AND s.open = 0 AND e.epoch = s.epoch - 1
WHERE s.scope = $1
UNION ALL
{_PEEK_COLUMNS}
JOIN loom_entries e ON e.scope = s.scope AND s.open = 0 AND {_NO_RUN}
WHERE s.scope = $1
"""
# The ownership check and the write are one statement: a run fenced out by a newer token
# inserts nothing. PostgreSQL also locks the session row FOR SHARE, so a takeover waits for
# an in-flight write to commit instead of racing it. A run position holds an entry already
# only when the step ran again over one it could not read (corrupt, or pickled): the write
# is tried as a plain insert, and only a duplicate key retries it as _REWRITE.
_WRITE = """
INSERT INTO loom_entries
    (scope, epoch, path, name, fingerprint, kind, format, codec_version, value, size, seq,
     created_at)
SELECT CAST($1 AS TEXT), CAST($2 AS BIGINT), CAST($3 AS TEXT), CAST($4 AS TEXT),
    CAST($5 AS TEXT), CAST($6 AS TEXT), CAST($7 AS TEXT), CAST($8 AS INTEGER), $9,
    CAST($10 AS INTEGER), CAST($11 AS INTEGER), {now}
FROM loom_sessions WHERE scope = $1 AND token = $12{lock}
"""
_REWRITE = (
    _WRITE
    + """ON CONFLICT (scope, epoch, path, name, fingerprint) DO UPDATE SET
    kind = excluded.kind, format = excluded.format, codec_version = excluded.codec_version,
    value = excluded.value, size = excluded.size, seq = excluded.seq,
    created_at = excluded.created_at
"""
)
_GET_IDEM = """
SELECT name, kind, format, codec_version, value
FROM loom_idempotency WHERE user_key = $1 AND idem_key = $2
"""
_PUT_IDEM = """
INSERT INTO loom_idempotency
    (user_key, idem_key, scope, name, kind, format, codec_version, value, size, created_at)
SELECT CAST($1 AS TEXT), CAST($2 AS TEXT), CAST($3 AS TEXT), CAST($4 AS TEXT),
    CAST($5 AS TEXT), CAST($6 AS TEXT), CAST($7 AS INTEGER), $8, CAST($9 AS INTEGER), {now}
FROM loom_sessions WHERE scope = $3 AND token = $10{lock}
ON CONFLICT (user_key, idem_key) DO NOTHING
RETURNING 1
"""
# Overwrites an unreadable (pickled or corrupt) idempotency row, and only that row: if a
# concurrent writer replaced it first, its result stands. Fenced like every write. $11-$13
# are the row's columns exactly as read (``StoredEntry.row``): a hand-edited SQLite row may
# hold an int, a real or text where the value's bytes belong, and only what it holds matches.
_REPLACE_IDEM = """
UPDATE loom_idempotency SET scope = $3, name = $4, kind = $5, format = $6,
    codec_version = $7, value = $8, size = $9, created_at = {now}
WHERE user_key = $1 AND idem_key = $2 AND format = $11 AND codec_version = $12
    AND value = $13
    AND EXISTS (SELECT 1 FROM loom_sessions WHERE scope = $3 AND token = $10{lock})
RETURNING 1
"""


def _replace_idem(stored: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]]:
    """``_REPLACE_IDEM`` and its $11-$13 for a row as read. A column holding text that is not
    UTF-8 (SQLite, see ``storage/_sqlite.read_text``) cannot be bound as read: its bytes are,
    cast back to the text they spell, so the damaged row is still the one replaced."""
    sql, bound = _REPLACE_IDEM, []
    for mark, value in zip(("$11", "$12", "$13"), stored, strict=True):
        if isinstance(value, str) and not is_unicode(value):
            sql = sql.replace(f"= {mark}", f"= CAST({mark} AS TEXT)")
            value = value.encode("utf-8", "surrogateescape")
        bound.append(value)
    return sql, tuple(bound)


_LIST = """
SELECT e.epoch, e.path, e.name, e.kind, e.size, e.seq, e.created_at, e.fingerprint
FROM loom_entries e WHERE e.scope = $1 ORDER BY e.epoch, e.seq
"""
_LIST_IDEM = """
SELECT idem_key, scope, name, kind, size, created_at
FROM loom_idempotency WHERE user_key = $1 ORDER BY created_at, idem_key
"""


_QUERIES = {
    "acquire": _ACQUIRE,
    "acquire_new": _ACQUIRE_NEW,
    "create_new": _CREATE_NEW,
    "holder": _HOLDER,
    "steal": _STEAL,
    "renew": _RENEW,
    "begin": _BEGIN,
    "reopen": _REOPEN,
    "release_advance": _RELEASE_ADVANCE,
    "status": _STATUS,
    "record": _RECORD,
    "cancel": _CANCEL,
    "claim_orphan": _CLAIM_ORPHAN,
    "dead_letter_seen": _DEAD_LETTER_SEEN,
    "dead_letter_free": _DEAD_LETTER_FREE,
    "note_error": _NOTE_ERROR,
    "requeue": _REQUEUE,
    "count_closed": _COUNT_CLOSED,
    "state_rows": _STATE_ROWS,
    "release_keep": _RELEASE_KEEP,
    "load_run": _LOAD_RUN,
    "peek": _PEEK,
    "write": _WRITE,
    "get_idem": _GET_IDEM,
    "put_idem": _PUT_IDEM,
    "list": _LIST,
    "list_idem": _LIST_IDEM,
}


def _entry(row: Sequence[Any]) -> StoredEntry:
    """A journal row as _LOAD_RUN reads it: path ... seq, then its epoch (see _NO_RUN)."""
    entry = _stored(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7])
    epoch = row[8]
    if type(epoch) is not int:
        entry.damage = f"a {type(epoch).__name__} ({shown(epoch)}) for its epoch"
    return entry


def _stored(
    path: str, name: str, fp: str, kind: str, fmt: Any, version: Any, value: Any, seq: Any = 0
) -> StoredEntry:
    """A journal or idempotency row as read, never failing on what a row holds.

    SQLite keeps any type in any column, so a row edited by hand may hold text where the
    value's bytes belong (``UPDATE ... SET value = '{...}'``) or text in a number column. Text
    is read as its UTF-8 bytes (the stored form is UTF-8 JSON); anything else a row cannot
    hold makes it an entry in a format no runtime reads, which the journal treats as corrupt
    (the step runs again; strict mode raises) instead of failing the whole resume.
    """
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogateescape")
    if type(seq) is not int or not 0 <= seq < _SEQ_LIMIT:
        # Only orders a run's entries; a damaged one must not break that, nor number the
        # run's next entry past what the column holds (a hand-edited 2**31 - 1).
        seq = -1
    if (
        isinstance(value, bytes | bytearray | memoryview)
        and type(version) is int
        and isinstance(fmt, str)
    ):
        return StoredEntry(path, name, fp, kind, fmt, version, bytes(value), seq)
    what = f"value {type(value).__name__}, codec_version {type(version).__name__}"
    return StoredEntry(path, name, fp, kind, f"unreadable row ({what})", 0, b"", seq)


def _ids_damage(scope: object, session_id: object, user_id: object) -> str | None:
    """Why an open run's row names a run its key is not (a session or user column edited by
    hand), or ``None``. A claim finds the run by the key made from the ids, so it would miss
    such a row at every sweep, as if another worker kept taking it first."""
    if not isinstance(session_id, str) or not (user_id is None or isinstance(user_id, str)):
        return "its session id or user id is not text"
    try:
        key = Scope(session_id, user_id).key
    except (UserError, ValueError) as exc:
        return f"its ids are not valid ids ({exc})"[:300]
    if key != scope:
        return "its session id and user id are not those its key was made from"
    return None


# Listings describe rows for people (`runs list`, `runs show`, `users export`): a row edited
# by hand shows what it holds, or -1 / NaN, instead of failing the whole listing.
def _int(value: Any) -> int:
    return value if type(value) is int else -1


def _float(value: Any) -> float:
    return float(value) if type(value) in (int, float) else float("nan")


def _listed_damage(row: Sequence[Any]) -> str | None:
    """Why a row of ``_LIST`` (epoch, path, name, ..., fingerprint) is one no step matches."""
    epoch, raw_path, name, fingerprint = row[0], row[1], row[2], row[7]
    if type(epoch) is not int:
        return f"a {type(epoch).__name__} ({shown(epoch)}) for its epoch"
    damage = key_damage(raw_path, name, fingerprint)
    if damage is None and _parsed_path(raw_path) is None:
        damage = "a sub-run path that is not a list of names"
    return damage


def _parsed_path(raw: Any) -> tuple[str, ...] | None:
    try:
        path = json.loads(raw)
    except (TypeError, ValueError, RecursionError):
        return None
    if isinstance(path, list) and all(isinstance(p, str) for p in path):
        return tuple(path)
    return None


def _path(raw: Any) -> tuple[str, ...]:
    path = _parsed_path(raw)
    return (f"<unreadable path {str(raw)[:60]!r}>",) if path is None else path


def _damage(token: object, epoch: object, is_open: object, *, unclaimed: bool = False) -> list[str]:
    """The columns of a lease row that hold what no claim or release writes (none: sound).

    SQLite keeps text or a blob in a number column, and a BIGINT or SMALLINT takes numbers no
    run reaches. An ``open`` other than 0 or 1 used to read as an open run, so a resume of a
    finished run ran a fresh epoch and its journaled steps again.
    """
    found = []
    lowest = 0 if unclaimed else 1  # a row no claim has taken yet (a 0.20 import) holds 0
    if type(token) is not int or not lowest <= token < _LAST_NUMBER:
        found.append(f"token {shown(token)}")
    if type(epoch) is not int or not 0 <= epoch < _LAST_NUMBER:
        found.append(f"epoch {shown(epoch)}")
    if type(is_open) is not int or is_open not in (0, 1):
        found.append(f"open {shown(is_open)}")
    return found


def _damaged(scope: Scope, found: Sequence[str]) -> CorruptEntryError:
    return CorruptEntryError(
        f"the session's lease row is damaged ({', '.join(found)}); repair or delete the "
        f"loom_sessions row of session {shown(scope.session_id)} of user "
        f"{shown(scope.user_id)}"
    )


def _claim(scope: Scope, rows: Sequence[Sequence[Any]]) -> Claim | None:
    if not rows:
        return None
    token, epoch, is_open, status = rows[0]
    if found := _damage(token, epoch, is_open):
        # A session row edited by hand: a typed error naming the damage before any step
        # runs, not a ValueError or an overflow when the run closes, nor a fresh epoch.
        raise _damaged(scope, found)
    return Claim(token, epoch, bool(is_open), status == "cancelled")


class SqlJournalStore:
    """Journal storage over a :class:`~loomflow.storage.Database` (SQLite or PostgreSQL)."""

    def __init__(self, db: Database, *, owns_db: bool = True) -> None:
        self.db = db
        self.backend = db.backend
        self._owns_db = owns_db
        # The runtime decides when to open and whether to migrate; the report of a 0.20
        # journal comes first, so it is made even when the schema check refuses.
        self._life = SqlLifecycle(
            db,
            COMPONENT,
            MIGRATIONS,
            owns_db=owns_db,
            auto_migrate=True,
            on_open=report_on_open,
        )

    async def open(self, *, migrate: bool) -> None:
        await self._life.open_now(migrate=migrate)

    async def close(self) -> None:
        await self._life.close()

    async def migrate(self) -> int:
        return await self._life.migrate()

    async def _run(self, what: str, query: str, *args: Any) -> Sequence[Sequence[Any]]:
        return await self.db.fetch(_QUERIES[query], *args, what=f"journal {what}")

    async def try_acquire(self, scope: Scope, owner: str, lease_s: float) -> Claim | None:
        rows = await self._run(
            "acquire", "acquire", scope.key, scope.session_id, scope.user_id, owner, float(lease_s)
        )
        return _claim(scope, rows)

    async def try_begin(
        self, scope: Scope, owner: str, lease_s: float, record: tuple[str, str, bytes] | None
    ) -> Claim | None:
        return await self._open_new("acquire_new", scope, owner, lease_s, record)

    async def try_create(
        self, scope: Scope, owner: str, lease_s: float, record: tuple[str, str, bytes] | None
    ) -> Claim | None:
        return await self._open_new("create_new", scope, owner, lease_s, record)

    async def _open_new(
        self,
        statement: str,
        scope: Scope,
        owner: str,
        lease_s: float,
        record: tuple[str, str, bytes] | None,
    ) -> Claim | None:
        """Claim the turn and open a run in one write, where ``statement`` allows it."""
        agent, config, raw = record if record is not None else (None, None, None)
        rows = await self._run(
            "acquire",
            statement,
            scope.key,
            scope.session_id,
            scope.user_id,
            owner,
            float(lease_s),
            agent,
            config,
            raw,
        )
        return _claim(scope, rows)

    async def holder(self, scope: Scope) -> tuple[str, int] | None:
        rows = await self._run("read", "holder", scope.key)
        if not rows:
            return None
        owner, token, epoch, is_open, lease_until = rows[0]
        # Read before any claim statement could check the row, and the only read of its
        # lease: one no claim writes (text, NaN, infinity) never runs out, so the wait for it
        # would end in SessionBusyError after the whole turn timeout.
        found = _damage(token, epoch, is_open)
        if not isinstance(owner, str):
            found.append(f"owner {shown(owner)}")
        if type(lease_until) not in (int, float) or not math.isfinite(lease_until):
            found.append(f"lease_until {shown(lease_until)}")
        if found:
            raise _damaged(scope, found)
        return owner, token

    async def steal(
        self, scope: Scope, seen_token: int, owner: str, lease_s: float
    ) -> Claim | None:
        rows = await self._run("takeover", "steal", scope.key, owner, seen_token, float(lease_s))
        return _claim(scope, rows)

    async def renew(self, scope: Scope, token: int, lease_s: float) -> bool:
        return bool(await self._run("lease renewal", "renew", scope.key, token, float(lease_s)))

    async def begin_run(
        self, scope: Scope, token: int, record: tuple[str, str, bytes] | None = None
    ) -> bool:
        agent, config, raw = record if record is not None else (None, None, None)
        return bool(await self._run("write", "begin", scope.key, token, agent, config, raw))

    async def reopen(self, scope: Scope, token: int, epoch: int) -> bool:
        return bool(await self._run("write", "reopen", scope.key, token, epoch))

    async def release(
        self, scope: Scope, token: int, advance_to: int | None, status: str | None = None
    ) -> bool:
        if advance_to is None:
            return bool(await self._run("write", "release_keep", scope.key, token))
        return bool(
            await self._run("write", "release_advance", scope.key, token, advance_to, status)
        )

    async def run_status(self, scope: Scope) -> str | None:
        rows = await self._run("read", "status", scope.key)
        return rows[0][0] if rows and isinstance(rows[0][0], str) else None

    async def run_record(self, scope: Scope) -> bytes | None:
        rows = await self._run("read", "record", scope.key)
        raw = rows[0][0] if rows else None
        return bytes(raw) if isinstance(raw, bytes | bytearray | memoryview) else None

    async def cancel(self, scope: Scope) -> bool:
        return bool(await self._run("cancel", "cancel", scope.key))

    async def open_runs(self, limit: int, prefer: Sequence[str] = ()) -> list[RunRow]:
        # Runs of agents this recoverer serves come first, so that many orphans it must leave
        # alone (another deployment's agents) never crowd its own out of the batch. Within
        # them, rows whose lease ran out (or that nobody holds) come before rows still leased:
        # most of those are live runs the recoverer skips, and a batch full of them hid every
        # orphan behind it while as many runs as the batch holds were going on.
        names = list(prefer)[:100]
        order = ""
        if names:
            marks = ", ".join(f"${i + 2}" for i in range(len(names)))
            order = f"CASE WHEN agent IN ({marks}) THEN 0 ELSE 1 END, "
        rows = await self.db.fetch(
            _OPEN_RUNS.replace("{prefer}", order), limit, *names, what="journal read"
        )
        found = []
        for r in rows:
            session_id, user_id, owner, token, lease_until, now, attempts, retry_at = r[:8]
            agent, config, record, scope, last_error = r[8:13]
            damage = _ids_damage(scope, session_id, user_id)
            if damage is None and (type(token) is not int or token < 0):
                # No claim can fence it: one bound by the number it reads as ('-1' for text)
                # never matched, and a negative one was claimed up to 0 one sweep at a time,
                # each sweep calling it lost to another worker.
                damage = f"its lease row holds token {shown(token)}"
            found.append(
                RunRow(
                    session_id if isinstance(session_id, str) else None,
                    user_id if isinstance(user_id, str) else None,
                    owner if isinstance(owner, str) else None,
                    _int(token),
                    _float(lease_until),
                    float(now),
                    _int(attempts),
                    _float(retry_at),
                    agent if isinstance(agent, str) else None,
                    config if isinstance(config, str) else None,
                    bytes(record) if isinstance(record, bytes | bytearray | memoryview) else None,
                    damage,
                    last_error if isinstance(last_error, str) else None,
                )
            )
        return found

    async def claim_orphan(
        self,
        scope: Scope,
        seen_token: int,
        owner: str,
        lease_s: float,
        backoff_s: float,
        owner_dead: bool,
    ) -> OrphanClaim | None:
        rows = await self._run(
            "recovery claim",
            "claim_orphan",
            scope.key,
            owner,
            seen_token,
            float(lease_s),
            float(backoff_s),
            int(owner_dead),
        )
        if not rows:
            return None
        token = rows[0][0]
        if type(token) is not int or not 0 < token < _LAST_NUMBER:
            # The guard above left it unchanged: no fencing is possible.
            raise _damaged(scope, [f"token {shown(token)}"])
        return OrphanClaim(token, _int(rows[0][1]))

    async def dead_letter(self, scope: Scope, seen_token: int | None, error: str) -> bool:
        if seen_token is None:
            return bool(await self._run("write", "dead_letter_free", scope.key, error))
        return bool(await self._run("write", "dead_letter_seen", scope.key, seen_token, error))

    async def note_error(self, scope: Scope, error: str) -> None:
        await self._run("write", "note_error", scope.key, error)

    async def requeue(self, scope: Scope) -> bool:
        return bool(await self._run("write", "requeue", scope.key))

    async def count_states(self) -> dict[str, int]:
        counts = dict.fromkeys(RUN_STATES, 0)
        for status, count in await self._run("read", "count_closed"):
            if status is None:
                state = "finished"
            elif status in FINAL_STATUSES:
                state = str(status)
            else:
                state = UNREADABLE
            counts[state] = counts.get(state, 0) + int(count)
        for is_open, owner, lease_until, now, status, attempts, token, epoch in await self._run(
            "read", "state_rows"
        ):
            state = run_state(
                open=is_open,
                owner=owner,
                lease_until=lease_until,
                now=float(now),
                status=status,
                attempts=attempts,
            )
            if _damage(token, epoch, is_open, unclaimed=True):  # as `runs list` says it
                state = UNREADABLE
            counts[state] = counts.get(state, 0) + 1
        return counts

    async def load_run(self, scope: Scope, epoch: int) -> list[StoredEntry]:
        return [_entry(r) for r in await self._run("read", "load_run", scope.key, epoch)]

    async def peek_last_run(self, scope: Scope) -> LastRun | None:
        rows = await self._run("read", "peek", scope.key)
        if not rows:
            return None
        token, epoch, is_open, status, owner = rows[0][:5]
        if _damage(token, epoch, is_open):
            return None  # damaged: the claim a resume falls back to names it
        # e.scope is NULL only on the row a run without entries gives.
        entries = [_entry(r[6:]) for r in rows if r[5] is not None]
        return LastRun(
            token,
            epoch,
            bool(is_open),
            status if isinstance(status, str) else None,
            owner is not None,
            entries,
        )

    async def write_entry(self, scope: Scope, token: int, epoch: int, entry: StoredEntry) -> bool:
        # A row count, not RETURNING: on SQLite RETURNING made the fenced write cost 1.2x a
        # plain INSERT at synchronous=FULL and 2.3x at NORMAL; counted, it costs the same.
        args = (
            scope.key,
            epoch,
            entry.path,
            entry.name,
            entry.fingerprint,
            entry.kind,
            entry.format,
            entry.codec_version,
            entry.value,
            len(entry.value),
            entry.seq,
            token,
        )
        added = await self.db.insert_new(_WRITE, *args, what="journal write")
        if added is None:  # the position holds an entry the step ran again over
            added = await self.db.count(_REWRITE, *args, what="journal write")
        return added > 0

    async def get_idempotent(self, user_key: str, key: str) -> StoredEntry | None:
        rows = await self._run("read", "get_idem", user_key, key)
        if not rows:
            return None
        name, kind, fmt, version, value = rows[0]
        entry = _stored("", name, "", kind, fmt, version, value)
        entry.row = (fmt, version, value)  # as stored, for a conditional replace of the row
        return entry

    async def put_idempotent(
        self,
        scope: Scope,
        token: int,
        key: str,
        entry: StoredEntry,
        *,
        replacing: StoredEntry | None = None,
    ) -> StoredEntry | None:
        args = (
            scope.user_key,
            key,
            scope.key,
            entry.name,
            entry.kind,
            entry.format,
            entry.codec_version,
            entry.value,
            len(entry.value),
            token,
        )
        if replacing is not None:
            # Matched on the row as stored, not as decoded: a damaged row reads as an entry
            # in no format with no value, which no stored row equals, so it was never
            # replaced and every retry ran the step again.
            stored = replacing.as_stored()
            sql, bound = _replace_idem(stored)
            if await self.db.fetch(sql, *args, *bound, what="journal write"):
                return entry
            current = await self.get_idempotent(scope.user_key, key)
            if current is not None:
                unchanged = current.as_stored() == stored
                return None if unchanged else current  # unchanged: we were fenced out
            # The row was pruned meanwhile: insert as usual.
        rows = await self._run("write", "put_idem", *args)
        if rows:
            return entry
        # Nothing inserted: either an earlier writer holds the key, or we were fenced out.
        return await self.get_idempotent(scope.user_key, key)

    async def list_entries(self, session_id: str | None, user_id: str | None) -> list[EntryInfo]:
        rows = await self._run("read", "list", Scope(session_id, user_id).key)
        return [
            EntryInfo(
                session_id,
                user_id,
                _int(r[0]),
                _path(r[1]),
                str(r[2]),
                str(r[3]),
                _int(r[4]),
                _int(r[5]),
                _float(r[6]),
                _listed_damage(r),
            )
            for r in rows
        ]

    async def list_idempotent(self, user_id: str | None) -> list[IdempotentInfo]:
        rows = await self._run("read", "list_idem", Scope(None, user_id).user_key)
        return [
            IdempotentInfo(
                user_id, str(r[0]), scope_session(r[1]), str(r[2]), str(r[3]), _int(r[4]),
                _float(r[5]),
            )
            for r in rows
        ]  # fmt: skip

    async def list_sessions(
        self,
        user_id: str | None,
        by_user: bool,
        limit: int,
        session_id: str | None = None,
        state: str | None = None,
    ) -> list[SessionInfo]:
        conditions: list[str] = []
        args: list[Any] = []

        def param(value: Any) -> str:
            args.append(value)
            return f"${len(args)}"

        if by_user:
            conditions.append(sessions_of(user_id, param, "s."))
        if session_id is not None:
            conditions.append(f"s.session_id = {param(session_id)}")
        if state is not None:
            conditions.append(_STATE_PREFILTER[state])
        where = ("WHERE " + " AND ".join(conditions)) if conditions else ""
        found: list[SessionInfo] = []
        # The state filter is finished in Python (an owner's liveness is not in the row), so
        # rows are read page by page until ``limit`` of them match.
        page = max(limit, 200)
        offset = 0
        while len(found) < limit:
            rows = await self.db.fetch(
                "SELECT s.session_id, s.user_id, s.epoch, s.open, s.owner, s.updated_at, "
                "(SELECT COUNT(*) FROM loom_entries e WHERE e.scope = s.scope), "
                "s.lease_until, {now}, s.status, s.attempts, s.agent, s.config, s.last_error, "
                f"s.created_at, s.token, s.scope FROM loom_sessions s {where} "
                f"ORDER BY s.updated_at DESC, s.scope LIMIT ${len(args) + 1} "
                f"OFFSET ${len(args) + 2}",
                *args,
                page,
                offset,
                what="journal read",
            )
            for r in rows:
                info = _session_info(r)
                if state is None or info.state == state:
                    found.append(info)
            if len(rows) < page:
                break
            offset += page
        return found[:limit]

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
        # One reading of the database clock bounds the whole prune: the count and every batch
        # use the same cutoff, and rows written while the prune runs are left alone, as the
        # single DELETE this replaces left them (its snapshot could not see them).
        now = float((await self._fetch_raw("SELECT {now}", []))[0][0])
        args: list[Any] = []

        def param(value: Any) -> str:
            args.append(value)
            return f"${len(args)}"

        if any_age:  # an erasure: every row of the user, whatever time it says it was written
            where = ["1 = 1"]
        elif older_than_s is None:
            where = [f"created_at <= {param(now)}"]
        else:
            where = [f"created_at < {param(now - older_than_s)}"]
        scope_filters: list[str] = []
        if by_session:
            scope_filters.append(
                f"session_id = {param(session_id)}"
                if session_id is not None
                else "session_id IS NULL"
            )
        if by_user:
            scope_filters.append(sessions_of(user_id, param))
        if scope_filters:
            where.append(
                "scope IN (SELECT scope FROM loom_sessions WHERE "
                + " AND ".join(scope_filters)
                + ")"
            )
        if not include_open:
            where.append(
                "NOT EXISTS (SELECT 1 FROM loom_sessions s WHERE s.scope = loom_entries.scope"
                " AND s.open = 1 AND s.epoch = loom_entries.epoch)"
            )
        if keep_users:  # users under legal hold: none of their entries go
            held = [sessions_of(user, param) for user in dict.fromkeys(keep_users)]
            where.append(
                "scope NOT IN (SELECT scope FROM loom_sessions WHERE " + " OR ".join(held) + ")"
            )
        targets = [_Prune("loom_entries", _ENTRY_KEY, where, args)]
        # Idempotency results outlive runs on purpose; only age (with the user filter) drops them.
        if (older_than_s is not None or any_age) and not by_session:
            idem_where = ["1 = 1" if any_age else "created_at < $1"]
            idem_args: list[Any] = [] if any_age else [now - (older_than_s or 0.0)]
            if by_user:
                idem_args.append(json_user_key(user_id))
                idem_where.append(f"user_key = ${len(idem_args)}")
            if keep_users:
                marks = []
                for user in keep_users:
                    idem_args.append(json_user_key(user))
                    marks.append(f"${len(idem_args)}")
                idem_where.append(f"user_key NOT IN ({', '.join(marks)})")
            targets.append(_Prune("loom_idempotency", _IDEM_KEY, idem_where, idem_args))
        if dry_run:
            counts = [(await self._fetch_raw(t.count_sql(), t.args))[0][0] for t in targets]
            return sum(int(c) for c in counts)
        return await self._delete(targets, batch_size, on_progress)

    async def _delete(
        self, targets: list[_Prune], batch_size: int, on_progress: OnProgress | None
    ) -> int:
        total = None
        if on_progress is not None:
            total = 0
            for target in targets:
                total += int((await self._fetch_raw(target.count_sql(), target.args))[0][0])
        progress = Progress(on_progress, total)
        for target in targets:
            # Keyset batches: each one is the key range after the previous batch's last key,
            # so rows a prune keeps (open runs, younger entries) are read once, not per batch.
            after: Sequence[Any] | None = None
            while True:
                found = await self._fetch_raw(
                    target.nth_key_sql(after), [*target.args, *(after or ()), batch_size - 1]
                )
                upto = tuple(found[0]) if found else None
                deleted = await self._fetch_raw(
                    target.delete_sql(after, upto), [*target.args, *(after or ()), *(upto or ())]
                )
                progress.advance(len(deleted))
                if upto is None:  # the range ran to the end of the table
                    break
                after = upto
        progress.finish()
        return progress.done

    async def forget_sessions(self, user_id: str | None) -> int:
        args: list[Any] = []

        def param(value: Any) -> str:
            args.append(value)
            return f"${len(args)}"

        cond = sessions_of(user_id, param)
        # A lease whose holder is known to be dead (a worker on this host killed during a
        # run) protects nothing: its row, which holds the run's inputs, goes too. Matched on
        # the owner text, so a run that claims the row meanwhile keeps it.
        leased = await self.db.fetch(
            f"SELECT DISTINCT owner FROM loom_sessions WHERE {cond} "
            "AND owner IS NOT NULL AND lease_until >= {now}",
            *args,
            what="journal forget",
        )
        dead = [
            r[0]
            for r in leased
            if isinstance(r[0], str) and is_unicode(r[0]) and _lease.holder_is_dead(r[0])
        ]
        marks = ", ".join(f"${len(args) + 1 + i}" for i in range(len(dead)))
        released = f" OR owner IN ({marks})" if dead else ""
        rows = await self.db.fetch(
            f"DELETE FROM loom_sessions WHERE {cond} "
            f"AND (owner IS NULL OR lease_until < {{now}}{released}) "
            "AND NOT EXISTS (SELECT 1 FROM loom_entries e WHERE e.scope = loom_sessions.scope) "
            "RETURNING 1",
            *args,
            *dead,
            what="journal forget",
        )
        return len(rows)

    async def _fetch_raw(self, sql: str, args: list[Any]) -> Sequence[Sequence[Any]]:
        return await self.db.fetch(sql, *args, what="journal prune")


# SQL that narrows ``runs list --state``; :func:`run_state` decides on what it lets through.
_STATE_PREFILTER = {
    "running": "s.owner IS NOT NULL",
    "orphaned": "s.open = 1 AND s.status IS NULL",
    "open": "s.open = 1 AND s.status IS NULL AND s.owner IS NULL AND s.attempts = 0",
    "finished": "s.open = 0 AND s.status IS NULL",
    "interrupted": "s.status = 'interrupted'",
    "failed": "s.status = 'failed'",
    "cancelled": "s.status = 'cancelled'",
    UNREADABLE: "1 = 1",
}


def _moved(scope: object, session_id: object, user_id: object) -> bool:
    """Whether a session row's id columns are not the ids its key was made from (edited by
    hand): listed under the user its key names, it reads as unreadable, not as theirs."""
    if not all(v is None or isinstance(v, str) for v in (session_id, user_id)):
        return False  # not text: reported as such
    try:
        return Scope(session_id, user_id).key != scope  # type: ignore[arg-type]
    except (UserError, ValueError):
        return True


def _session_info(r: Sequence[Any]) -> SessionInfo:
    """A listing row; a damaged one reads as ``unreadable`` (and -1/NaN), never an error."""
    state = run_state(
        open=r[3], owner=r[4], lease_until=r[7], now=float(r[8]), status=r[9], attempts=r[10]
    )
    if _damage(r[15], r[2], r[3], unclaimed=True):  # a token or epoch resume refuses
        state = UNREADABLE
    elif any(not (v is None or (isinstance(v, str) and is_unicode(v))) for v in r[:2]):
        # A session or user id that is not UTF-8 (see storage/_sqlite.read_text) names no
        # session anyone can show, resume or cancel; nor does a blob, which the listing
        # would otherwise show as no id at all (the anonymous user's run).
        state = UNREADABLE
    elif _moved(r[16], r[0], r[1]):
        state = UNREADABLE
    return SessionInfo(
        r[0] if isinstance(r[0], str) else None,
        r[1] if isinstance(r[1], str) else None,
        _int(r[2]),
        bool(r[3]) if type(r[3]) is int else False,
        r[4] if isinstance(r[4], str) else None,
        _float(r[5]),
        _int(r[6]),
        state=state,
        agent=r[11] if isinstance(r[11], str) else None,
        config=r[12] if isinstance(r[12], str) else None,
        attempts=_int(r[10]),
        last_error=r[13] if isinstance(r[13], str) else None,
        created_at=_float(r[14]),
    )


# Primary keys, with the SQL types their values are compared as.
_ENTRY_KEY = (
    ("scope", "TEXT"),
    ("epoch", "BIGINT"),
    ("path", "TEXT"),
    ("name", "TEXT"),
    ("fingerprint", "TEXT"),
)
_IDEM_KEY = (("user_key", "TEXT"), ("idem_key", "TEXT"))


@dataclass(frozen=True, slots=True)
class _Prune:
    """The rows of one table that a prune deletes: ``where`` uses ``$1..$len(args)``."""

    table: str
    key: tuple[tuple[str, str], ...]
    where: list[str]
    args: list[Any]

    def count_sql(self) -> str:
        return f"SELECT COUNT(*) FROM {self.table} WHERE {' AND '.join(self.where)}"

    def _range(self, after: Sequence[Any] | None, upto: Sequence[Any] | None) -> str:
        where = list(self.where)
        first = len(self.args) + 1
        if after is not None:
            where.append(_key_compare(self.key, ">", first, after))
            first += len(self.key)
        if upto is not None:
            where.append(_key_compare(self.key, "<=", first, upto))
        return " AND ".join(where)

    def nth_key_sql(self, after: Sequence[Any] | None) -> str:
        """The key that ends the next batch (the last parameter is the batch size - 1)."""
        limit = len(self.args) + 1 + (len(self.key) if after is not None else 0)
        columns = ", ".join(name for name, _ in self.key)
        return (
            f"SELECT {columns} FROM {self.table} WHERE {self._range(after, None)} "
            f"ORDER BY {columns} LIMIT 1 OFFSET ${limit}"
        )

    def delete_sql(self, after: Sequence[Any] | None, upto: Sequence[Any] | None) -> str:
        # Each batch is one autocommitted statement over a key range, so the locks it takes
        # last as long as one batch does; no rowid or ctid, the same SQL on both databases.
        return f"DELETE FROM {self.table} WHERE {self._range(after, upto)} RETURNING 1"


_KEY_TYPES = {"TEXT": str, "BIGINT": int}


def _key_compare(
    columns: Sequence[tuple[str, str]], op: str, first: int, key: Sequence[Any]
) -> str:
    """``(c1, c2, ...) op ($first, ...)``: a row-value comparison, which both databases answer
    from the primary key index. The casts tell PostgreSQL the parameters' types.

    A key value of another type than its column's (only SQLite keeps one: text in a
    hand-edited epoch, a blob path) is bound as it is: cast, it would name another key
    ('zero' becomes 0), and a prune would go round the same batch forever.
    """
    names = ", ".join(name for name, _ in columns)
    values = ", ".join(
        f"CAST(${first + i} AS {kind})" if type(value) is _KEY_TYPES[kind] else f"${first + i}"
        for i, ((_, kind), value) in enumerate(zip(columns, key, strict=True))
    )
    return f"({names}) {op} ({values})"


def json_user_key(user_id: str | None) -> str:
    return Scope(None, user_id).user_key


def sessions_of(user_id: str | None, param: Callable[[Any], str], table: str = "") -> str:
    """SQL true for a ``loom_sessions`` row of ``user_id``: its user_id column names them,
    or its scope key does. The key is what runs are found by, so a column edited by hand
    must not take a user's runs out of their listing, export or erasure, nor out of the
    legal hold that keeps them; the key's last element is the user (compact JSON, so the
    user's part ``,"alice"]`` ends it exactly when it is theirs)."""
    tail = "," + json_user_key(user_id)[1:]
    named = (
        f"{table}user_id = {param(user_id)}" if user_id is not None else f"{table}user_id IS NULL"
    )
    keyed = (
        f"substr({table}scope, length({table}scope) - {param(len(tail))} + 1) "
        f"= CAST({param(tail)} AS TEXT)"
    )
    return f"({named} OR {keyed})"
