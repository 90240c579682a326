"""Upgrading from loomflow 0.20: its journal is noticed, reported, and imported so it replays.

Each test builds a 0.20-shaped journal (``journal_steps``, ``journal_streams``,
``checkpoints``) in a real SQLite file or a real PostgreSQL database, with values written as
literal tagged JSON and hashes that are *not* this release's, as 0.20's own would be.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loomflow import Agent, ToolCall, tool
from loomflow.errors import LegacyJournalError
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import (
    LAYOUT_0_20,
    JournalRuntime,
    PostgresRuntime,
    SqliteRuntime,
    import_legacy_journal,
    inspect_legacy_journal,
)

# -- a 0.20 journal, as rows ---------------------------------------------------------------


def _model(cls: str, **fields: Any) -> dict[str, Any]:
    """A pydantic value in tagged JSON, spelled out (not produced by this release's encoder)."""
    return {"$t": "model", "v": {"cls": cls, "fields": fields}}


def _usage(i: int, o: int) -> dict[str, Any]:
    return _model("loomflow.messages:Usage", input_tokens=i, output_tokens=o)


def _asks(call_id: str, name: str, arguments: dict[str, Any]) -> str:
    """A model call's stream that asks for one tool call."""
    call = _model("loomflow.messages:ToolCall", id=call_id, name=name, arguments=arguments)
    return json.dumps(
        [
            _model(
                "loomflow.messages:ToolCallDelta",
                type="tool_call_delta",
                index=0,
                id=call_id,
                name=name,
                arguments_delta=json.dumps(arguments),
            ),
            _model(
                "loomflow.messages:ModelResponse",
                type="response",
                text="",
                tool_calls=[call],
                usage=_usage(20, 8),
                finish_reason="tool_calls",
                model="function",
            ),
        ]
    )


def _says(text: str) -> str:
    """A model call's stream that answers with text."""
    return json.dumps(
        [
            _model("loomflow.messages:TextDelta", type="text_delta", text=text),
            _model(
                "loomflow.messages:ModelResponse",
                type="response",
                text=text,
                tool_calls=[],
                usage=_usage(10, 2),
                finish_reason="stop",
                model="function",
            ),
        ]
    )


def _outcome(value: str) -> str:
    return json.dumps(_model("loomflow.tools:ToolOutcome", ok=True, value=value))


# A value the decoder must refuse: a tag it does not know. (A row naming a class that is not
# registered, such as subprocess:Popen, decodes as plain data and runs nothing: see
# tests/runtime/test_codec_security.py.)
_HOSTILE = json.dumps({"$t": "exec", "v": "touch /tmp/pwned-by-0.20"})

T0 = 1_750_000_000.0

# (table, session, user, epoch, seq, step_key, fingerprint, value, finished)
ROWS: list[tuple[str, str, str | None, int, int, str, str, str, bool]] = [
    # alice's "trip": run 0 finished; run 1 booked a flight and a hotel, then its process died.
    ("journal_streams", "trip", "alice", 0, 0, "model_call_0", "020-a0", _says("hi"), True),
    ("journal_streams", "trip", "alice", 1, 0, "model_call_0", "020-a1",
     _asks("old-1", "book", {"what": "flight"}), False),
    ("journal_steps", "trip", "alice", 1, 1, "tool_call_0_0_9f2c1e0d5a7b3c44", "020-a2",
     _outcome("booked flight #1"), False),
    ("journal_streams", "trip", "alice", 1, 2, "model_call_1", "020-a3",
     _asks("old-2", "book", {"what": "hotel"}), False),
    ("journal_steps", "trip", "alice", 1, 3, "tool_call_1_0_0b7e55aa12cd9f01", "020-a4",
     _outcome("booked hotel #2"), False),
    # bob reused the session id "trip": his own bucket, one finished run.
    ("journal_streams", "trip", "bob", 0, 0, "model_call_0", "020-b0", _says("hi bob"), True),
    # an anonymous session with a finished run and a value that must not decode.
    ("journal_streams", "notes", None, 0, 0, "model_call_0", "020-n0", _says("noted"), True),
    ("journal_steps", "notes", None, 0, 1, "lookup", "020-n1", _HOSTILE, True),
]  # fmt: skip

CHECKPOINTS = [("trip", "alice", 1, 1, json.dumps([{"role": "user", "content": "plan"}]))]


@dataclass
class Legacy:
    """A database holding a 0.20 journal, and how to reach it."""

    backend: str
    url: str
    open_runtime: Callable[..., Awaitable[JournalRuntime]]
    dump: Callable[[], Awaitable[dict[str, Any]]]  # the 0.20 tables: schema and every row
    count_entries: Callable[[], Awaitable[int]]


_SQLITE_DDL = [
    """CREATE TABLE journal_steps (session_id TEXT NOT NULL, user_id TEXT,
        epoch INTEGER NOT NULL, seq INTEGER NOT NULL, step_key TEXT NOT NULL,
        fingerprint TEXT NOT NULL, value TEXT NOT NULL, finished INTEGER NOT NULL,
        created_at REAL NOT NULL)""",
    """CREATE TABLE journal_streams (session_id TEXT NOT NULL, user_id TEXT,
        epoch INTEGER NOT NULL, seq INTEGER NOT NULL, step_key TEXT NOT NULL,
        fingerprint TEXT NOT NULL, value TEXT NOT NULL, finished INTEGER NOT NULL,
        created_at REAL NOT NULL)""",
    """CREATE TABLE checkpoints (session_id TEXT NOT NULL, user_id TEXT, epoch INTEGER,
        turn INTEGER, messages TEXT, created_at REAL)""",
]
# PostgreSQL with the types a PostgreSQL schema would pick: JSONB, BOOLEAN, TIMESTAMPTZ.
_PG_DDL = [
    """CREATE TABLE journal_steps (session_id TEXT NOT NULL, user_id TEXT,
        epoch BIGINT NOT NULL, seq INTEGER NOT NULL, step_key TEXT NOT NULL,
        fingerprint TEXT NOT NULL, value JSONB NOT NULL, finished BOOLEAN NOT NULL,
        created_at TIMESTAMPTZ NOT NULL)""",
    """CREATE TABLE journal_streams (session_id TEXT NOT NULL, user_id TEXT,
        epoch BIGINT NOT NULL, seq INTEGER NOT NULL, step_key TEXT NOT NULL,
        fingerprint TEXT NOT NULL, value JSONB NOT NULL, finished BOOLEAN NOT NULL,
        created_at TIMESTAMPTZ NOT NULL)""",
    """CREATE TABLE checkpoints (session_id TEXT NOT NULL, user_id TEXT, epoch BIGINT,
        turn INTEGER, messages JSONB, created_at TIMESTAMPTZ)""",
]
_LEGACY = ("journal_steps", "journal_streams", "checkpoints")


def _write_sqlite(path: Path, ddl: list[str], rows: list[tuple[Any, ...]]) -> None:
    with sqlite3.connect(path) as conn:
        for statement in ddl:
            conn.execute(statement)
        for i, (table, *values, finished) in enumerate(rows):
            conn.execute(
                f"INSERT INTO {table} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*values, int(finished), T0 + i),
            )
        for c in CHECKPOINTS if any("checkpoints" in s for s in ddl) else []:
            conn.execute("INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?, ?)", (*c, T0))
    conn.close()


async def _write_pg(dsn: str, ddl: list[str], rows: list[tuple[Any, ...]]) -> None:
    import datetime as dt

    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        for statement in ddl:
            await conn.execute(statement)
        for i, (table, *values, finished) in enumerate(rows):
            await conn.execute(
                f"INSERT INTO {table} VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                *values,
                finished,
                dt.datetime.fromtimestamp(T0 + i, dt.UTC),
            )
        for c in CHECKPOINTS if any("checkpoints" in s for s in ddl) else []:
            await conn.execute(
                "INSERT INTO checkpoints VALUES ($1, $2, $3, $4, $5, $6)",
                *c,
                dt.datetime.fromtimestamp(T0, dt.UTC),
            )
    finally:
        await conn.close()


def _sqlite_dump(path: Path) -> dict[str, Any]:
    with sqlite3.connect(path) as conn:
        out: dict[str, Any] = {}
        for table in _LEGACY:
            schema = conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (table,))
            out[f"{table}:schema"] = schema.fetchall()
            out[table] = conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2, 3, 4").fetchall()
    conn.close()
    return out


async def _pg_dump(dsn: str) -> dict[str, Any]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        out: dict[str, Any] = {}
        for table in _LEGACY:
            out[f"{table}:schema"] = [
                tuple(r)
                for r in await conn.fetch(
                    "SELECT column_name, data_type FROM information_schema.columns "
                    "WHERE table_name = $1 ORDER BY ordinal_position",
                    table,
                )
            ]
            # md5 of each row's text form: a checksum that sees any change to any column.
            out[table] = sorted(
                r[0] for r in await conn.fetch(f"SELECT md5(t::text) FROM {table} t")
            )
    finally:
        await conn.close()
    return out


async def _make_legacy(
    backend: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    ddl: tuple[list[str], list[str]] = (_SQLITE_DDL, _PG_DDL),
    rows: list[tuple[Any, ...]] | None = None,
) -> AsyncIterator[Legacy]:
    rows = ROWS if rows is None else rows
    opened: list[JournalRuntime] = []
    if backend == "sqlite":
        path = tmp_path / "journal-0.20.db"
        _write_sqlite(path, ddl[0], rows)

        async def open_sqlite(**options: Any) -> JournalRuntime:
            runtime = SqliteRuntime(path, **options)
            opened.append(runtime)
            return runtime

        async def count_sqlite() -> int:
            with sqlite3.connect(path) as conn:
                (n,) = conn.execute("SELECT COUNT(*) FROM loom_entries").fetchone()
            conn.close()
            return int(n)

        async def dump_sqlite() -> dict[str, Any]:
            return _sqlite_dump(path)

        yield Legacy("sqlite", f"sqlite:///{path}", open_sqlite, dump_sqlite, count_sqlite)
    else:
        dsn = request.getfixturevalue("pg_dsn")
        await _write_pg(dsn, ddl[1], rows)

        async def open_pg(**options: Any) -> JournalRuntime:
            runtime = PostgresRuntime(dsn, **options)
            opened.append(runtime)
            return runtime

        async def count_pg() -> int:
            import asyncpg

            conn = await asyncpg.connect(dsn)
            try:
                return int(await conn.fetchval("SELECT COUNT(*) FROM loom_entries"))
            finally:
                await conn.close()

        async def dump_pg() -> dict[str, Any]:
            return await _pg_dump(dsn)

        yield Legacy("postgres", dsn, open_pg, dump_pg, count_pg)
    for runtime in opened:
        await runtime.close()


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
async def legacy(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Legacy]:
    async for made in _make_legacy(request.param, tmp_path, request):
        yield made


# -- an agent like the one that wrote the 0.20 journal -------------------------------------


@dataclass
class Trip:
    agent: Agent
    model: FunctionModel
    bookings: list[str]


def _trip_agent(runtime: JournalRuntime, *, die_before_answering: bool = False) -> Trip:
    bookings: list[str] = []

    @tool
    def book(what: str) -> str:
        """Book something (a side effect that must not happen twice)."""
        bookings.append(what)
        return f"booked {what} #{len(bookings)}"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        done = [m for m in messages if m.role == "tool"]
        if not done:
            return [ToolCall(id="new-1", name="book", arguments={"what": "flight"})]
        if len(done) == 1:
            return [ToolCall(id="new-2", name="book", arguments={"what": "hotel"})]
        if die_before_answering:
            raise RuntimeError("the 0.20 worker died here")
        return "trip ready: " + "; ".join(m.content for m in done)

    model = FunctionModel(decide)
    agent = Agent("You plan trips.", model=model, tools=[book], runtime=runtime, memory=False)
    return Trip(agent, model, bookings)


# -- tests -----------------------------------------------------------------------------------


def _legacy_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "loomflow.runtime" and r.levelno == logging.WARNING and "0.20" in r.message
    ]


async def test_open_warns_once_with_what_the_020_journal_holds(
    legacy: Legacy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="loomflow.runtime")
    first = await legacy.open_runtime()
    await first.open()
    assert await first.sessions() == []  # the old journal is not read as this release's
    await first.close()
    second = await legacy.open_runtime()  # another runtime on the same database
    await second.open()
    async with second.session("other", "carol"):
        pass
    warned = _legacy_warnings(caplog)
    assert len(warned) == 1, [r.message for r in warned]
    message = warned[0].message
    assert "3 sessions" in message
    assert "1 open run" in message
    assert "journal_steps: 3 rows" in message
    assert "journal_streams: 5 rows" in message
    assert "checkpoints: 1 row" in message
    assert "loomflow migrate --import-0.20" in message
    found = await inspect_legacy_journal(second)
    assert found is not None
    assert (found.sessions, found.open_runs, found.imported) == (3, 1, 0)
    assert found.pending


async def test_import_replays_finished_tool_steps_and_resumes_the_open_run(
    legacy: Legacy,
) -> None:
    before = await legacy.dump()
    runtime = await legacy.open_runtime()
    report = await import_legacy_journal(runtime)
    assert (report.sessions, report.runs, report.open_runs) == (3, 4, 1)
    assert report.steps == 7  # 8 rows, less the one whose value must not decode
    assert report.undecodable == 1
    assert report.tool_steps_rekeyed == 2
    assert report.tool_steps_as_written == 0
    assert report.checkpoints == 1
    assert await legacy.dump() == before  # the 0.20 tables were only read

    listed = {(s.session_id, s.user_id): s for s in await runtime.sessions()}
    assert set(listed) == {("trip", "alice"), ("trip", "bob"), ("notes", None)}
    assert (listed["trip", "alice"].open, listed["trip", "alice"].epoch) == (True, 1)
    assert (listed["trip", "bob"].open, listed["trip", "bob"].epoch) == (False, 1)
    entries = await runtime.entries("trip", "alice")
    short = [(e.epoch, e.name.rsplit("_", 1)[0] if "tool" in e.name else e.name) for e in entries]
    assert short == [
        (0, "model_call_0"),
        (1, "model_call_0"),
        (1, "tool_call_0_0"),
        (1, "model_call_1"),
        (1, "tool_call_1_0"),
    ]

    # Resume alice's open run: both bookings replay; nothing is booked again.
    trip = _trip_agent(runtime)
    result = await trip.agent.run("plan my trip", session_id="trip", user_id="alice")
    assert trip.bookings == []
    assert result.output == "trip ready: booked flight #1; booked hotel #2"
    assert result.replayed_steps == 2  # the two tool calls, keyed from the model responses
    # 0.20's model-call fingerprints are not this release's: those calls diverge and run again.
    assert trip.model.calls == 3
    # The replayed results answer the calls the model issued now (new ids), as for any replay.
    tool_results = [m for m in result.messages if m.role == "tool"]
    assert [m.tool_call_id for m in tool_results] == ["new-1", "new-2"]

    # The resumed run finished: the next run of that session is a new one.
    again = await trip.agent.run("plan my trip", session_id="trip", user_id="alice")
    assert trip.bookings == ["flight", "hotel"]
    assert again.output == "trip ready: booked flight #1; booked hotel #2"

    found = await inspect_legacy_journal(runtime)
    assert found is not None
    assert not found.pending
    assert "all imported" in found.describe()


async def test_a_second_import_writes_nothing(legacy: Legacy) -> None:
    runtime = await legacy.open_runtime()
    first = await import_legacy_journal(runtime)
    assert first.sessions == 3
    entries = await legacy.count_entries()
    before = await legacy.dump()
    second = await import_legacy_journal(runtime)
    assert (second.sessions, second.steps, second.already_present) == (0, 0, 3)
    assert await legacy.count_entries() == entries
    assert await legacy.dump() == before


async def test_concurrent_imports_write_each_session_once(legacy: Legacy) -> None:
    one, two = await legacy.open_runtime(), await legacy.open_runtime()
    a, b = await asyncio.gather(import_legacy_journal(one), import_legacy_journal(two))
    assert a.sessions + b.sessions == 3
    assert a.steps + b.steps == 7
    assert await legacy.count_entries() == 7


async def test_sessions_run_since_the_upgrade_are_left_alone(legacy: Legacy) -> None:
    runtime = await legacy.open_runtime()
    # bob ran "trip" on this release before anyone imported: his new journal wins.
    async with runtime.session("trip", "bob") as run:
        await runtime.step("new_step", lambda: "new")
    assert run.epoch == 0
    report = await import_legacy_journal(runtime)
    assert (report.sessions, report.already_present) == (2, 1)
    entries = await runtime.entries("trip", "bob")
    assert [e.name for e in entries] == ["new_step"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_unexpected_layout_is_refused_by_name_and_left_unchanged(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # A journal_steps that calls its columns differently: reported, but never imported.
    other = "session_id TEXT, user_id TEXT, epoch INTEGER, key TEXT, payload TEXT, done INTEGER"
    ddl = [f"CREATE TABLE journal_steps ({other})"]
    rows: list[tuple[Any, ...]] = []
    async for legacy in _make_legacy(backend, tmp_path, request, ddl=(ddl, ddl), rows=rows):
        runtime = await legacy.open_runtime()
        await runtime.open()
        await runtime.database.execute(
            "INSERT INTO journal_steps VALUES ('s', 'u', 0, 'model_call_0', '[]', 0)"
        )
        found = await inspect_legacy_journal(runtime)
        assert found is not None
        assert (found.sessions, found.open_runs) == (1, 1)  # "done" read as the state column
        with pytest.raises(LegacyJournalError) as refused:
            await import_legacy_journal(runtime)
        error = refused.value
        assert error.table == "journal_steps"
        assert error.missing == (
            "seq",
            "step_key",
            "fingerprint",
            "value",
            "finished",
            "created_at",
        )
        assert error.unexpected == ("key", "payload", "done")
        assert "missing column(s) seq, step_key" in str(error)
        assert "unexpected column(s) key, payload, done" in str(error)
        assert await runtime.sessions() == []
        assert await legacy.count_entries() == 0


def test_our_tables_never_take_a_020_name() -> None:
    """0.20 found by table name is only safe if no table of ours has one of those names
    (this release's checkpoints live in loom_checkpoints, not checkpoints)."""
    import loomflow

    # Every table any store creates, read from the source so a new store is covered too.
    created = set()
    for source in Path(loomflow.__file__).parent.rglob("*.py"):
        text = source.read_text()
        created.update(re.findall(r"CREATE TABLE (?:IF NOT EXISTS )?(\w+)\s*\(", text))
    assert "loom_checkpoints" in created
    assert created.isdisjoint({"journal_steps", "journal_streams", "checkpoints"})
    assert all(name.startswith("loom_") for name in created)
    assert set(LAYOUT_0_20) == {"journal_steps", "journal_streams"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_cli_reports_then_imports(legacy: Legacy) -> None:
    before = await legacy.dump()
    run = asyncio.to_thread

    # Only `migrate` adds this release's tables: a listing stops with one line saying how.
    refused = await run(_cli, "--url", legacy.url, "runs", "list")
    assert refused.returncode == 1
    assert refused.stdout == ""
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert "holds a loomflow 0.20 journal and no store of this release" in refused.stderr
    assert f"run `loomflow migrate --url {legacy.url} --import-0.20`" in refused.stderr
    with pytest.raises(Exception, match="loom_entries"):  # no table of this release was made
        await legacy.count_entries()

    migrated = await run(_cli, "--url", legacy.url, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert "checkpoints schema at version" in migrated.stdout  # no clash with 0.20's table
    assert "3 sessions, 1 open run" in migrated.stdout
    assert "--import-0.20" in migrated.stdout
    assert migrated.stderr == ""

    listed = await run(_cli, "--url", legacy.url, "runs", "list")
    assert listed.returncode == 0, listed.stderr
    assert "no sessions in the journal" in listed.stdout
    assert "loomflow 0.20 journal" in listed.stdout
    assert "3 sessions, 1 open run" in listed.stdout
    assert "0.20" not in listed.stderr  # said once, not again as a log line

    as_json = await run(_cli, "--url", legacy.url, "runs", "list", "--json")
    assert as_json.stdout == ""  # JSON lines only; the note goes to stderr
    assert "3 sessions, 1 open run" in as_json.stderr

    imported = await run(_cli, "--url", legacy.url, "migrate", "--import-0.20")
    assert imported.returncode == 0, imported.stderr
    assert "imported 3 sessions from the loomflow 0.20 journal: 4 runs (1 open" in imported.stdout
    assert "Tool calls replay" in imported.stdout
    assert "1 step not imported" in imported.stdout  # the value that must not decode
    assert "1 checkpoint not imported" in imported.stdout

    listed = await run(_cli, "--url", legacy.url, "runs", "list")
    assert "open (resumable)" in listed.stdout
    assert "0.20" not in listed.stdout  # imported: nothing left to say here

    again = await run(_cli, "--url", legacy.url, "migrate", "--import-0.20")
    assert again.returncode == 0, again.stderr
    assert "nothing new to import" in again.stdout
    assert "left alone 3 sessions" in again.stdout
    assert await legacy.dump() == before


async def test_cli_names_the_columns_of_a_layout_it_will_not_import(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ddl = ["CREATE TABLE journal_steps (session_id TEXT, user_id TEXT, epoch INTEGER, blob BLOB)"]
    async for legacy in _make_legacy("sqlite", tmp_path, request, ddl=(ddl, ddl), rows=[]):
        refused = await asyncio.to_thread(_cli, "--url", legacy.url, "migrate", "--import-0.20")
        assert refused.returncode == 1
        assert "journal_steps" in refused.stderr
        assert "unexpected column(s) blob" in refused.stderr
        assert "missing column(s) seq, step_key" in refused.stderr


async def _rows_written_like_this_release(tmp_path: Path) -> list[tuple[Any, ...]]:
    """A 0.20 journal whose hashes happen to be this release's: a real run that crashed after
    two bookings, its entries copied into 0.20 rows (tool keys cut to their position)."""
    scratch = SqliteRuntime(tmp_path / "scratch.db")
    try:
        trip = _trip_agent(scratch, die_before_answering=True)
        with pytest.raises(RuntimeError, match="died here"):
            await trip.agent.run("plan my trip", session_id="trip", user_id="alice")
        assert trip.bookings == ["flight", "hotel"]
    finally:
        await scratch.close()
    with sqlite3.connect(tmp_path / "scratch.db") as conn:
        entries = conn.execute(
            "SELECT epoch, seq, name, fingerprint, kind, value FROM loom_entries ORDER BY seq"
        ).fetchall()
    conn.close()
    rows: list[tuple[Any, ...]] = []
    for epoch, seq, name, fp, kind, value in entries:
        table = "journal_streams" if kind == "stream" else "journal_steps"
        key = re.sub(r"^(tool_call_\d+_\d+)_[0-9a-f]+$", r"\1", name)
        rows.append((table, "trip", "alice", epoch, seq, key, fp, bytes(value).decode(), False))
    return rows


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_open_run_hashed_like_this_release_replays_every_step(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    rows = await _rows_written_like_this_release(tmp_path)
    assert [r[5] for r in rows] == [
        "model_call_0",
        "tool_call_0_0",
        "model_call_1",
        "tool_call_1_0",
    ]
    async for legacy in _make_legacy(backend, tmp_path, request, rows=rows):
        runtime = await legacy.open_runtime()
        report = await import_legacy_journal(runtime)
        assert (report.sessions, report.open_runs, report.steps) == (1, 1, 4)
        trip = _trip_agent(runtime)
        result = await trip.agent.run("plan my trip", session_id="trip", user_id="alice")
        assert trip.bookings == []
        assert trip.model.calls == 1  # only the answer the crashed run never got
        assert result.replayed_steps == 4
        assert result.output == "trip ready: booked flight #1; booked hotel #2"


async def test_the_warning_comes_even_when_automatic_migration_is_off(
    legacy: Legacy, caplog: pytest.LogCaptureFixture
) -> None:
    from loomflow.errors import MigrationError

    caplog.set_level(logging.WARNING, logger="loomflow.runtime")
    runtime = await legacy.open_runtime(auto_migrate=False)
    with pytest.raises(MigrationError, match="loomflow migrate"):
        await runtime.open()
    [warned] = _legacy_warnings(caplog)
    assert "3 sessions, 1 open run" in warned.message


def test_cli_import_without_a_020_journal_says_so(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    done = _cli("--url", url, "migrate", "--import-0.20")
    assert done.returncode == 0, done.stderr
    assert "no loomflow 0.20 journal in this database: nothing to import" in done.stdout
    listed = _cli("--url", url, "runs", "list")
    assert listed.stdout == "no sessions in the journal\n"
