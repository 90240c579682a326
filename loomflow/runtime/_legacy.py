"""Journals written by loomflow 0.20: noticed on open, reported, and imported on request.

loomflow 0.20 kept its journal in three tables, ``journal_steps``, ``journal_streams`` and
``checkpoints``. This release never reads them during a run: its own tables are all named
``loom_*`` (its checkpoints live in ``loom_checkpoints``), so the names cannot clash, and a
0.20 run resumed here would start from nothing. So that this never happens silently:

- opening a SQLite or PostgreSQL journal that holds 0.20 tables logs one warning per process
  and database, saying what they hold (sessions, open runs) and that they will not replay;
- :func:`inspect_legacy_journal` returns the same findings for ``loomflow migrate`` and
  ``loomflow runs list``;
- :func:`import_legacy_journal` (``loomflow migrate --import-0.20``) copies 0.20's sessions,
  runs and steps into this release's journal, so finished steps replay and open runs resume.

The 0.20 tables are only ever read (``SELECT``), never altered. Their rows are untrusted
input: values are decoded with the journal codec (which rebuilds only allowed types and never
runs code) and re-encoded; ids go through the same checks as a caller's.

The source of 0.20 is not at hand, so finding and importing are kept apart. Finding matches
table names and reads the columns a table really has (matching common spellings for the
session, user, run and state columns), counting what those columns allow. Importing needs the
exact layout written down in :data:`LAYOUT_0_20` and refuses any other with
:class:`~loomflow.errors.LegacyJournalError`, naming the missing and unexpected columns.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from ..errors import LegacyJournalError, LoomflowError, UserError
from ..storage import Database, Transaction, unbounded
from . import codec
from ._names import tool_step_name
from ._store import Scope, fingerprint, path_key

if TYPE_CHECKING:
    from ..messages import ModelResponse

__all__ = [
    "LAYOUT_0_20",
    "LEGACY_TABLES",
    "LegacyImport",
    "LegacyJournal",
    "LegacyTable",
    "import_legacy_journal",
    "inspect_legacy_journal",
]

log = logging.getLogger("loomflow.runtime")

LEGACY_TABLES: Final = ("journal_steps", "journal_streams", "checkpoints")
"""The tables of a loomflow 0.20 database (this release's own tables all start with ``loom_``)."""

_JOURNAL_TABLES: Final = ("journal_steps", "journal_streams")

_STEP_COLUMNS: Final[Mapping[str, str]] = {
    "session_id": "the session id (text): loom_sessions.session_id",
    "user_id": "the user id (text, NULL for no user): loom_sessions.user_id",
    "epoch": "the run, numbered from 0 per (session, user): loom_entries.epoch",
    "seq": "the step's position in its run: orders loom_entries.seq",
    "step_key": "the step name: model_call_<turn>, tool_call_<turn>_<slot>[_<hash>], "
    "persist_episode_<n> or a custom name: loom_entries.name",
    "fingerprint": "0.20's hash of the step's inputs: loom_entries.fingerprint (tool calls "
    "are re-keyed, see import_legacy_journal)",
    "value": "the result as tagged JSON (text, JSON or bytes): decoded, then re-encoded",
    "finished": "true once the run returned; a false row in a session's last run makes that "
    "run open (resumable)",
    "created_at": "when the row was written (Unix seconds or a timestamp)",
}

LAYOUT_0_20: Final[Mapping[str, Mapping[str, str]]] = {
    "journal_steps": _STEP_COLUMNS,
    "journal_streams": {
        **_STEP_COLUMNS,
        "value": "the stream's chunks as one tagged JSON array (model calls end with their "
        "ModelResponse): decoded, then re-encoded",
    },
}
"""The 0.20 layout that :func:`import_legacy_journal` imports: per table, each column and
where it goes in this release's journal. ``journal_streams`` may be absent; ``checkpoints`` is
counted, not imported (a resumed run replays its journal instead of restoring a snapshot)."""

# Spellings looked for when only *describing* a 0.20 table (the import needs LAYOUT_0_20).
_SESSION_NAMES = ("session_id", "session")
_USER_NAMES = ("user_id", "user")
_RUN_NAMES = ("epoch", "run", "run_epoch", "run_no", "run_id")
_STATE_NAMES = ("finished", "done", "completed", "status", "state")
_FINISHED_WORDS = frozenset(
    {"1", "t", "true", "yes", "finished", "done", "completed", "complete", "returned", "ended"}
    | {"succeeded", "success", "interrupted"}
)

_TOOL_KEY = re.compile(r"tool_call_(\d+)_(\d+)(?:[_:][0-9A-Za-z]+)?")
_MODEL_KEY = re.compile(r"model_call_(\d+)")


@dataclass(frozen=True, slots=True)
class LegacyTable:
    """One 0.20 table as found: its columns (lower case, in order) and row count."""

    name: str
    columns: tuple[str, ...]
    rows: int


@dataclass(frozen=True, slots=True)
class LegacyJournal:
    """What a database holds of a loomflow 0.20 journal.

    Attributes:
        tables: The 0.20 tables present.
        sessions: Distinct (session, user) pairs, or ``None`` when no session column is known.
        open_runs: Sessions whose last run never returned, or ``None`` when the tables do not
            say (no run or state column).
        imported: Of ``sessions``, how many this release's journal already has (imported, or
            run again since), or ``None`` before this release's tables exist.
    """

    tables: tuple[LegacyTable, ...]
    sessions: int | None
    open_runs: int | None
    imported: int | None

    @property
    def pending(self) -> bool:
        """Whether some 0.20 sessions are not in this release's journal yet."""
        if self.sessions is None:
            return True
        return self.imported is None or self.imported < self.sessions

    def describe(self) -> str:
        """One paragraph for people: what is there, and what happens to it."""
        held = ", ".join(f"{t.name}: {_plural(t.rows, 'row')}" for t in self.tables)
        sessions = (
            "an unknown number of sessions"
            if self.sessions is None
            else _plural(self.sessions, "session")
        )
        runs = (
            "open runs unknown" if self.open_runs is None else _plural(self.open_runs, "open run")
        )
        what = f"this database holds a loomflow 0.20 journal ({held}) with {sessions}, {runs}"
        if not self.pending:
            return (
                f"{what}, all imported into this release's journal; the 0.20 tables are no "
                "longer read and may be dropped"
            )
        done = f" ({self.imported} already imported)" if self.imported else ""
        return (
            f"{what}{done}. This release does not replay 0.20 tables: resuming those runs "
            "would run every step again, side effects included. Import them with `loomflow "
            "migrate --import-0.20` (the 0.20 tables are only read, never changed)"
        )


@dataclass(slots=True)
class LegacyImport:
    """What :func:`import_legacy_journal` did.

    Attributes:
        sessions: (session, user) pairs imported now.
        already_present: Pairs left alone because this release's journal already has them
            (an earlier import, or runs made since the upgrade).
        runs: Runs imported; ``open_runs`` of them are open and resume where they stopped.
        steps: Journal entries written.
        tool_steps_rekeyed: Tool steps keyed from the model response that asked for them.
        tool_steps_as_written: Tool steps kept under their 0.20 key (no single model response
            of that turn to key them from): they replay only if 0.20 hashed like this release.
        undecodable: Rows not imported because their value does not decode here (a type this
            process does not allow); those steps run again.
        malformed: Rows not imported because an id, run or position is unusable.
        checkpoints: Rows of 0.20's ``checkpoints`` (not imported).
    """

    sessions: int = 0
    already_present: int = 0
    runs: int = 0
    open_runs: int = 0
    steps: int = 0
    tool_steps_rekeyed: int = 0
    tool_steps_as_written: int = 0
    undecodable: int = 0
    malformed: int = 0
    checkpoints: int = 0

    def describe(self) -> str:
        """A few lines for people."""
        if self.sessions:
            lines = [
                f"imported {_plural(self.sessions, 'session')} from the loomflow 0.20 journal: "
                f"{_plural(self.runs, 'run')} ({self.open_runs} open, resumable), "
                f"{_plural(self.steps, 'step')}. Tool calls replay (keyed by turn, slot and "
                "the call the model asked for); model calls replay if 0.20 fingerprinted their "
                "inputs as this release does, else they run (and are billed) again"
            ]
        else:
            lines = ["nothing new to import from the loomflow 0.20 journal"]
        if self.already_present:
            lines.append(
                f"left alone {_plural(self.already_present, 'session')} already in this "
                "journal (imported before, or run since the upgrade)"
            )
        if self.tool_steps_as_written:
            lines.append(
                f"{_plural(self.tool_steps_as_written, 'tool step')} kept under 0.20's key (no "
                "single model response of that turn to key them from): they replay only if "
                "0.20 hashed tool calls as this release does, else they run again"
            )
        if self.undecodable:
            lines.append(
                f"{_plural(self.undecodable, 'step')} not imported, because a stored value "
                "holds a type this process does not allow to be decoded (register it with "
                "loomflow.runtime.register_type and import from Python): those steps run again"
            )
        if self.malformed:
            lines.append(
                f"{_plural(self.malformed, 'row')} not imported: an unusable id, run, "
                "position or value"
            )
        if self.checkpoints:
            lines.append(
                f"{_plural(self.checkpoints, 'checkpoint')} not imported: resume() replays "
                "the imported journal instead"
            )
        return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# -- finding ---------------------------------------------------------------------------------


def _database(runtime: Any) -> Database:
    database = getattr(runtime, "database", None)
    if not isinstance(database, Database):
        raise UserError(
            f"{runtime!r} keeps no database: 0.20 journals live in SQLite or PostgreSQL"
        )
    return database


async def _tables(db: Database) -> dict[str, tuple[str, ...]]:
    """The 0.20 tables present, with their columns in order (lower case)."""
    found: dict[str, list[str]] = {}
    if db.backend == "postgres":
        # to_regclass resolves names through search_path, as the unqualified SELECTs below do.
        rows = await db.fetch(
            "SELECT c.relname, a.attname FROM pg_attribute a JOIN pg_class c "
            "ON c.oid = a.attrelid WHERE c.oid IN (to_regclass('journal_steps'), "
            "to_regclass('journal_streams'), to_regclass('checkpoints')) "
            "AND a.attnum > 0 AND NOT a.attisdropped ORDER BY c.relname, a.attnum",
            what="0.20 journal lookup",
        )
        for table, column in rows:
            found.setdefault(str(table).lower(), []).append(str(column).lower())
    else:
        names = await db.fetch(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND lower(name) IN "
            "('journal_steps', 'journal_streams', 'checkpoints')",
            what="0.20 journal lookup",
        )
        for (name,) in names:
            columns = await db.fetch(
                "SELECT name FROM pragma_table_info($1)", name, what="0.20 journal lookup"
            )
            found[str(name).lower()] = [str(c[0]).lower() for c in columns]
    return {name: tuple(found[name]) for name in LEGACY_TABLES if name in found}


def _pick(columns: Sequence[str], names: Sequence[str]) -> str | None:
    return next((name for name in names if name in columns), None)


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _finished(value: Any) -> bool | None:
    if isinstance(value, bool | int):
        return bool(value)
    if isinstance(value, str):
        return value.strip().lower() in _FINISHED_WORDS
    return None


async def inspect_legacy_journal(runtime: Any) -> LegacyJournal | None:
    """What the runtime's database holds of a loomflow 0.20 journal; ``None`` if nothing.

    A database counts as holding one when ``journal_steps`` or ``journal_streams`` exists
    (a ``checkpoints`` table alone may belong to another library). Reads only.

    Raises:
        UserError: the runtime keeps no database (``InMemoryRuntime``).
    """
    db = _database(runtime)
    await db.open()
    return await _inspect(db)


async def _inspect(db: Database) -> LegacyJournal | None:
    present = await _tables(db)
    if not any(name in present for name in _JOURNAL_TABLES):
        return None
    tables: list[LegacyTable] = []
    pairs: set[tuple[Any, Any]] = set()
    sessions_known = False
    # (session, user) -> run -> whether every row of that run says it finished
    runs: dict[tuple[Any, Any], dict[Any, bool]] = {}
    runs_known = True
    unknown_table = False
    for name, columns in present.items():
        count = await db.fetch(f"SELECT COUNT(*) FROM {name}", what="0.20 journal read")
        tables.append(LegacyTable(name, columns, int(count[0][0])))
        if name == "checkpoints":
            continue  # snapshots of journal sessions: counted as rows, not as sessions
        session = _pick(columns, _SESSION_NAMES)
        if session is None:
            unknown_table = True  # its sessions cannot be counted, so no total can be given
            runs_known = False
            continue
        sessions_known = True
        user, run, state = (_pick(columns, n) for n in (_USER_NAMES, _RUN_NAMES, _STATE_NAMES))
        selected = ", ".join(_quoted(c) if c else "NULL" for c in (session, user, run, state))
        # DISTINCT keeps this to about one row per run, however many steps the runs made.
        rows = await db.fetch(f"SELECT DISTINCT {selected} FROM {name}", what="0.20 journal read")
        for session_id, user_id, run_id, state_value in rows:
            pairs.add((session_id, user_id))
            if run is None or state is None:
                runs_known = False
                continue
            done = _finished(state_value)
            pair_runs = runs.setdefault((session_id, user_id), {})
            pair_runs[run_id] = pair_runs.get(run_id, True) and done is True
    sessions_known = sessions_known and not unknown_table
    open_runs: int | None = None
    if runs_known and sessions_known:
        open_runs = 0
        for pair_runs in runs.values():
            try:
                last = max(pair_runs)
            except TypeError:  # run ids of mixed types: no order to find the last one by
                open_runs = None
                break
            open_runs += not pair_runs[last]
    imported = await _already_imported(db, pairs) if sessions_known else None
    return LegacyJournal(
        tables=tuple(tables),
        sessions=len(pairs) if sessions_known else None,
        open_runs=open_runs,
        imported=imported,
    )


def _scope_of(session_id: Any, user_id: Any) -> Scope | None:
    try:
        return Scope.checked(session_id, user_id)
    except UserError:
        return None


async def _already_imported(db: Database, pairs: Iterable[tuple[Any, Any]]) -> int | None:
    """How many of the pairs this release's journal has a session row for."""
    if db.backend == "postgres":
        exists = "SELECT to_regclass('loom_sessions') IS NOT NULL"
    else:
        exists = "SELECT COUNT(*) > 0 FROM sqlite_master WHERE name = 'loom_sessions'"
    if not (await db.fetch(exists, what="0.20 journal lookup"))[0][0]:
        return None
    keys = [scope.key for scope in map(lambda p: _scope_of(*p), pairs) if scope is not None]
    found = 0
    for start in range(0, len(keys), 500):  # well under SQLite's limit on bound parameters
        batch = keys[start : start + 500]
        marks = ", ".join(f"${i + 1}" for i in range(len(batch)))
        rows = await db.fetch(
            f"SELECT COUNT(*) FROM loom_sessions WHERE scope IN ({marks})",
            *batch,
            what="0.20 journal lookup",
        )
        found += int(rows[0][0])
    return found


# -- the warning on open ---------------------------------------------------------------------

_reported: set[str] = set()


def _identity(db: Database) -> str:
    path = getattr(db, "path", None)
    if path is not None:
        return f"sqlite:{path.resolve() if str(path) != ':memory:' else id(db)}"
    dsn = getattr(db, "_dsn", None)
    return f"postgres:{dsn if dsn is not None else id(db)}"


def quiet_on_open(runtime: Any) -> None:
    """Skip the warning on open for this runtime's database (a command that reports the 0.20
    journal itself, so the operator does not read it twice)."""
    database = getattr(runtime, "database", None)
    if isinstance(database, Database):
        _reported.add(_identity(database))


async def report_on_open(db: Database) -> None:
    """Log, once per process and database, what a 0.20 journal in ``db`` holds.

    Never fails the open: a 0.20 table that cannot be read is logged at debug level.
    """
    key = _identity(db)
    if key in _reported:
        return
    _reported.add(key)
    try:
        found = await _inspect(db)
    except LoomflowError:
        log.debug("could not inspect the 0.20 tables", exc_info=True)
        return
    if found is None:
        return
    if found.pending:
        log.warning("%s", found.describe())
    else:
        log.info("%s", found.describe())


# -- importing -------------------------------------------------------------------------------


def _check_layout(table: str, columns: Sequence[str]) -> None:
    expected = LAYOUT_0_20[table]
    missing = tuple(c for c in expected if c not in columns)
    unexpected = tuple(c for c in columns if c not in expected)
    if missing or unexpected:
        raise LegacyJournalError(table, missing, unexpected)


@dataclass(slots=True)
class _Row:
    """One usable 0.20 row, decoded."""

    epoch: int
    seq: int
    order: int  # steps before streams at equal seq (two tables, two numberings)
    name: str
    fingerprint: str
    kind: str
    value: Any
    finished: bool
    created_at: float


@dataclass(slots=True)
class _Run:
    rows: list[_Row] = field(default_factory=list)


def _as_bytes(value: Any) -> bytes | None:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    return None


def _as_time(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, dt.datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
        return float(aware.timestamp())
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
        try:
            return _as_time(dt.datetime.fromisoformat(value))
        except ValueError:
            return None
    return None


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value)
    return None


def _response_of(value: Any) -> ModelResponse | None:
    """The model response a model-call step holds (its last chunk, for a stream)."""
    from ..messages import ModelResponse  # messages registers its types with this package

    if isinstance(value, ModelResponse):
        return value
    if isinstance(value, list):
        return next((c for c in reversed(value) if isinstance(c, ModelResponse)), None)
    return None


def _rekey_tools(run: _Run, report: LegacyImport) -> None:
    """Key a run's tool steps as this release does: position plus a hash of the call.

    The position (turn, slot) comes from the 0.20 key; the call (tool name and arguments)
    from the model response of that turn, which is what asked for it. The hash 0.20 put in
    its key is never trusted, so the mapping does not depend on how 0.20 computed it.
    """
    responses: dict[int, list[ModelResponse]] = {}
    for row in run.rows:
        match = _MODEL_KEY.fullmatch(row.name)
        response = _response_of(row.value) if match else None
        if match and response is not None:
            responses.setdefault(int(match.group(1)), []).append(response)
    for row in run.rows:
        match = _TOOL_KEY.fullmatch(row.name)
        if match is None or row.kind != "step":
            continue
        turn, slot = int(match.group(1)), int(match.group(2))
        asked = responses.get(turn, [])
        # Two responses for one turn (0.20 re-ran a diverged call): which one asked is unknown.
        if len(asked) != 1 or slot >= len(asked[0].tool_calls):
            report.tool_steps_as_written += 1
            continue
        call = asked[0].tool_calls[slot]
        row.name = tool_step_name(turn, slot, call)
        # The agent journals a tool call as step(name, invoke, call.name, call.arguments).
        row.fingerprint = fingerprint((call.name, call.arguments), {})
        report.tool_steps_rekeyed += 1


async def _session_ids(db: Database, tables: Sequence[str]) -> list[Any]:
    seen: dict[Any, None] = {}
    for table in tables:
        rows = await db.fetch(f"SELECT DISTINCT session_id FROM {table}", what="0.20 journal read")
        for (session_id,) in rows:
            seen.setdefault(session_id, None)
    return list(seen)


_Raw = tuple[str, Sequence[Any]]  # (kind, the row's epoch .. created_at as read)


async def _raw_rows(
    db: Database, table: str, sessions: Sequence[Any], into: dict[tuple[Any, Any], list[_Raw]]
) -> None:
    """The rows of ``sessions`` (a chunk: one scan of the table per chunk, not per session),
    grouped by (session, user) as read. Ids are passed back as read, so that they compare in
    the column's own type."""
    values = [s for s in sessions if s is not None]
    where = []
    if values:
        where.append(f"session_id IN ({', '.join(f'${i + 1}' for i in range(len(values)))})")
    if len(values) < len(sessions):
        where.append("session_id IS NULL")
    rows = await db.fetch(
        "SELECT session_id, user_id, epoch, seq, step_key, fingerprint, value, finished, "
        f"created_at FROM {table} WHERE {' OR '.join(where)}",
        *values,
        what="0.20 journal read",
    )
    kind = "stream" if table == "journal_streams" else "step"
    for row in rows:
        into.setdefault((row[0], row[1]), []).append((kind, tuple(row[2:])))


def _decoded(
    kind: str,
    epoch: Any,
    seq: Any,
    name: Any,
    fp: Any,
    value: Any,
    finished: Any,
    created_at: Any,
    *,
    report: LegacyImport,
) -> _Row | None:
    """One 0.20 row checked and decoded, or ``None`` (counted) when it cannot be imported."""
    epoch_n, seq_n, data = _as_int(epoch), _as_int(seq), _as_bytes(value)
    if (
        epoch_n is None
        or epoch_n < 0
        or seq_n is None
        or not isinstance(name, str)
        or not name
        or "\x00" in name
        or not isinstance(fp, str)
        or data is None
    ):
        report.malformed += 1
        return None
    try:
        decoded = codec.loads(data)
    except Exception:  # untrusted: whatever fails to decode is simply not imported
        report.undecodable += 1
        return None
    if kind == "stream" and not isinstance(decoded, list):
        report.malformed += 1
        return None
    return _Row(
        epoch=epoch_n,
        seq=seq_n,
        order=0 if kind == "step" else 1,
        name=name,
        fingerprint=fp,
        kind=kind,
        value=decoded,
        finished=_finished(finished) is True,
        created_at=_as_time(created_at) or time.time(),
    )


_INSERT_SESSION = """
INSERT INTO loom_sessions
    (scope, session_id, user_id, epoch, open, owner, token, lease_until, updated_at)
VALUES ($1, $2, $3, $4, $5, NULL, 0, 0, $6)
ON CONFLICT (scope) DO NOTHING
RETURNING 1
"""
_INSERT_ENTRY = """
INSERT INTO loom_entries
    (scope, epoch, path, name, fingerprint, kind, format, codec_version, value, size, seq,
     created_at)
VALUES ($1, $2, $3, $4, $5, $6, 'json', $7, $8, $9, $10, $11)
ON CONFLICT (scope, epoch, path, name, fingerprint) DO NOTHING
RETURNING 1
"""


async def import_legacy_journal(runtime: Any) -> LegacyImport:
    """Copy a loomflow 0.20 journal into this release's journal, in the same database.

    Each (session, user) becomes a session of this journal at the run it had reached: the
    epoch after its last run, or that run itself when it never returned (open, so the next
    ``agent.run()`` or ``agent.resume()`` with the same prompt replays its finished steps).
    Every step keeps its run, position, name and fingerprint, except tool calls, which are
    keyed from the model response that asked for them (see :data:`LAYOUT_0_20`). Model calls
    replay if 0.20 fingerprinted their inputs as this release does; otherwise the resumed run
    logs a divergence and calls the model again, and its tool calls still replay.

    Each session is imported in one transaction, and only if this journal does not have it
    yet, so a second import (or one racing another) writes nothing twice, and sessions run
    since the upgrade are left alone. The 0.20 tables are only read.

    Values are decoded with the journal codec in *this* process: types that the application
    registers with :func:`~loomflow.runtime.register_type` decode only where they are
    registered, so an application with its own result types imports from its own code.

    Returns:
        What was imported and what was not (and why): show ``report.describe()`` to whoever
        runs the upgrade.

    Raises:
        LegacyJournalError: a 0.20 table's columns differ from :data:`LAYOUT_0_20`.
        UserError: the runtime keeps no database (``InMemoryRuntime``).
    """
    db = _database(runtime)
    await runtime.open()  # this release's tables must exist (migrated, or checked)
    present = await _tables(db)
    report = LegacyImport()
    tables = [t for t in _JOURNAL_TABLES if t in present]
    if not tables:
        return report
    for table in tables:
        _check_layout(table, present[table])
    if "checkpoints" in present:
        count = await db.fetch("SELECT COUNT(*) FROM checkpoints", what="0.20 journal read")
        report.checkpoints = int(count[0][0])
    sessions = await _session_ids(db, tables)
    for start in range(0, len(sessions), _CHUNK):
        grouped: dict[tuple[Any, Any], list[_Raw]] = {}
        for table in tables:
            await _raw_rows(db, table, sessions[start : start + _CHUNK], grouped)
        await _import_chunk(db, grouped, report)
    return report


# Sessions read, decoded and written together: one scan of each 0.20 table and one transaction
# per chunk. Measured on SQLite, 1000 sessions of 20 steps: one transaction per session
# spent most of its time in fsyncs and per-session scans (no index on 0.20's side).
_CHUNK = 100


async def _import_chunk(
    db: Database, grouped: dict[tuple[Any, Any], list[_Raw]], report: LegacyImport
) -> None:
    scopes: dict[tuple[Any, Any], Scope] = {}
    for pair, raws in grouped.items():
        scope = _scope_of(*pair)
        if scope is None:
            report.malformed += len(raws)
        else:
            scopes[pair] = scope
    keys = [scope.key for scope in scopes.values()]
    present: set[str] = set()
    if keys:
        marks = ", ".join(f"${i + 1}" for i in range(len(keys)))
        rows = await db.fetch(
            f"SELECT scope FROM loom_sessions WHERE scope IN ({marks})", *keys, what="0.20 import"
        )
        present = {str(r[0]) for r in rows}
    todo: list[tuple[Scope, list[_Row]]] = []
    for pair, scope in scopes.items():
        if scope.key in present:
            report.already_present += 1  # imported before, or run since the upgrade
            continue
        decoded = [_decoded(kind, *raw, report=report) for kind, raw in grouped[pair]]
        rows_of_pair = [row for row in decoded if row is not None]
        if rows_of_pair:
            todo.append((scope, rows_of_pair))
    if not todo:
        return
    # Decoded before the transaction: SQLite's write lock is held for the writes only.
    with unbounded():  # one transaction for the whole import, however big
        async with db.transaction(what="0.20 import") as tx:
            for scope, rows_of_pair in todo:
                await _import_session(tx, scope, rows_of_pair, report)


async def _import_session(
    tx: Transaction, scope: Scope, rows: list[_Row], report: LegacyImport
) -> None:
    runs: dict[int, _Run] = {}
    for row in rows:
        runs.setdefault(row.epoch, _Run()).rows.append(row)
    last = max(runs)
    is_open = not all(row.finished for row in runs[last].rows)
    rekeyed, as_written = report.tool_steps_rekeyed, report.tool_steps_as_written
    for run in runs.values():
        run.rows.sort(key=lambda r: (r.seq, r.order, r.created_at))
        _rekey_tools(run, report)
    updated = max(row.created_at for row in rows)
    root = path_key(())
    claimed = await tx.fetch(
        _INSERT_SESSION,
        scope.key,
        scope.session_id,
        scope.user_id,
        last if is_open else last + 1,
        1 if is_open else 0,
        updated,
    )
    if not claimed:  # a worker (or another import) created it since the check before
        report.already_present += 1
        report.tool_steps_rekeyed, report.tool_steps_as_written = rekeyed, as_written
        return
    written = 0
    for epoch, run in sorted(runs.items()):
        for seq, row in enumerate(run.rows):
            raw = codec.dumps(row.value)
            done = await tx.fetch(
                _INSERT_ENTRY,
                scope.key,
                epoch,
                root,
                row.name,
                row.fingerprint,
                row.kind,
                codec.CODEC_VERSION,
                raw,
                len(raw),
                seq,
                row.created_at,
            )
            written += len(done)
    report.sessions += 1
    report.runs += len(runs)
    report.open_runs += is_open
    report.steps += written
