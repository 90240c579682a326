"""The composition root: one place builds, places, migrates, exports and closes every store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loomflow import Agent, ToolCall, tool
from loomflow.audit import AuditLog, JsonlAuditStore, SqliteAuditStore, audit_store_from_url
from loomflow.checkpoints import checkpoint_store_from_url
from loomflow.config import Settings
from loomflow.errors import ConfigurationError, MigrationError, UserError
from loomflow.governance import StandardBudget
from loomflow.governance.budget import SqlBudgetStore, budget_store_from_url
from loomflow.memory import memory_from_url
from loomflow.models import ScriptedModel
from loomflow.runtime import runtime_from_url
from loomflow.storage import SqliteDatabase
from loomflow.stores import SCHEMES, Stores, store_from_url


@tool
def lookup(order_id: str) -> str:
    """Look an order up."""
    return f"{order_id}: shipped"


def _model() -> ScriptedModel:
    return ScriptedModel(
        [[ToolCall(id="c1", name="lookup", arguments={"order_id": "A-1"})], "A-1 has shipped."]
    )


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def journal_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'journal.db'}"
    dsn: str = request.getfixturevalue("pg_dsn")
    return dsn


async def test_the_five_stores_are_built_placed_migrated_exported_and_closed(
    journal_url: str,
) -> None:
    stores = Stores(Settings(runtime_url=journal_url))
    report = await stores.migrate()
    database = stores.database
    if journal_url.startswith("memory"):
        assert database is None
        # An in-memory journal keeps its budget and audit log in memory too.
        assert (stores.budget.backend, stores.audit.backend) == ("memory", "memory")
        assert "budget" not in report.versions()
    else:
        assert database is not None
        # Unless their URLs say otherwise, budget and audit share the journal's connection.
        assert getattr(stores.budget, "db", None) is database
        assert getattr(stores.audit, "db", None) is database
        versions = report.versions()
        assert set(versions) == {"journal", "checkpoints", "memory", "budget", "audit"}
        assert all(v >= 1 for v in versions.values())
        assert [s.store for s in report.steps] == [
            "journal",
            "checkpoints",
            "memory",
            "budget",
            "audit",
        ]
    # The stores an agent gets are those: one run lands in every one of them.
    agent = Agent(
        "Answer.",
        model=_model(),
        tools=[lookup],
        runtime=stores.runtime,
        audit=AuditLog(stores.audit),
        budget=StandardBudget([], store=stores.budget),
    )
    await agent.run("where is A-1?", session_id="s-1", user_id="ana")
    document = await stores.export_user("ana")
    counts = document["counts"]
    assert counts["sessions"] == 1
    assert counts["journal entries"] >= 3
    assert counts["audit entries"] >= 2
    assert document["audit"][0]["action"] == "run.start"
    assert sum(b["calls"] for b in document["budget"] if b["period"] == "all") == 2
    if database is not None:
        assert counts["episodes"] == 1  # memory lives beside the journal
    else:
        assert document["memory"] == {}
    await stores.close()
    if database is not None:
        assert not database.is_open
    # Nothing of another user leaks into the export.
    async with Stores(Settings(runtime_url=journal_url)) as again:
        if database is not None:
            other = await again.export_user("bob")
            assert other["counts"]["sessions"] == 0
            assert other["audit"] == []


async def test_urls_in_the_settings_move_the_audit_log_and_budget(tmp_path: Path) -> None:
    settings = Settings(
        runtime_url=f"sqlite:///{tmp_path / 'journal.db'}",
        audit_url=f"jsonl:///{tmp_path / 'audit.jsonl'}",
        budget_url=f"sqlite:///{tmp_path / 'budget.db'}",
    )
    async with Stores(settings) as stores:
        report = await stores.migrate()
        assert isinstance(stores.audit, JsonlAuditStore)
        assert isinstance(stores.budget, SqlBudgetStore)
        assert stores.budget.db is not stores.database
        budget_db = stores.budget.db
        messages = [s.message for s in report.steps]
        assert any(m.startswith("audit log (JSON lines)") and "(created;" in m for m in messages)
        assert "audit" not in report.versions()  # JSON lines have no schema
        assert report.versions()["budget"] >= 1
    assert (tmp_path / "audit.jsonl").exists()
    assert (tmp_path / "budget.db").exists()
    assert not budget_db.is_open  # closed with the rest
    # A second migrate finds the log and checks its heads.
    async with Stores(settings) as stores:
        report = await stores.migrate()
        assert any("exists, heads checked" in s.message for s in report.steps)


async def test_an_explicit_audit_url_overrides_the_setting(tmp_path: Path) -> None:
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}")
    audit = tmp_path / "elsewhere.db"
    async with Stores(settings, audit_url=f"sqlite:///{audit}") as stores:
        await stores.migrate()
        assert isinstance(stores.audit, SqliteAuditStore)
        assert stores.audit.db is not stores.database
    assert audit.exists()


async def test_without_a_journal_the_audit_log_is_at_runtime_url(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    async with Stores(Settings(runtime_url=f"sqlite:///{path}"), journal=False) as stores:
        assert stores.runtime is None
        assert stores.checkpoints is None
        assert stores.memory is None
        assert isinstance(stores.audit, SqliteAuditStore)
        assert stores.audit.db.path == path
        assert stores.budget.backend == "memory"


@pytest.mark.parametrize("kind", sorted(SCHEMES))
@pytest.mark.parametrize("url", ["redis://cache/0", "mysql://db/app", "s3://bucket/x"])
def test_a_bad_scheme_is_one_typed_error_listing_what_that_store_takes(kind: str, url: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        store_from_url(kind, url)  # type: ignore[arg-type]
    message = str(raised.value)
    assert kind in message
    assert url in message
    for scheme in SCHEMES[kind]:  # type: ignore[index]
        assert f"{scheme}://" in message
    assert ("jsonl://" in message) == (kind == "audit")


@pytest.mark.parametrize(
    ("build", "kind"),
    [
        (runtime_from_url, "journal"),
        (audit_store_from_url, "audit"),
        (checkpoint_store_from_url, "checkpoints"),
        (memory_from_url, "memory"),
        (budget_store_from_url, "budget"),
    ],
)
def test_the_old_url_functions_go_through_the_one_table(build: object, kind: str) -> None:
    with pytest.raises(ConfigurationError, match=f"unknown {kind} URL scheme"):
        build("redis://cache/0")  # type: ignore[operator]


# Every store's URL function; budget_store_from_url last (see below).
_FROM_URL = (
    runtime_from_url,
    audit_store_from_url,
    checkpoint_store_from_url,
    memory_from_url,
    budget_store_from_url,
)


@pytest.mark.parametrize("build", _FROM_URL)
def test_a_mistyped_scheme_does_not_show_the_password(build: Any) -> None:
    # "postgress://app:pw@db/x" (one s too many) was refused with the URL as given, password
    # included, in an error that ends up in logs; the settings already showed it masked.
    with pytest.raises(ConfigurationError, match=r"unknown .* URL scheme") as caught:
        build("postgress://app:s3cret@db:5432/app?password=s3cret")
    assert "s3cret" not in str(caught.value)
    assert "postgress://app:***@" in str(caught.value)


@pytest.mark.parametrize("url", [None, 5, "", "  "])
# budget_store_from_url(None or "") reads the settings' URL, as documented.
@pytest.mark.parametrize("build", _FROM_URL[:-1])
def test_a_url_that_is_no_text_or_empty_is_refused(build: Any, url: object) -> None:
    # None or a number was a bare AttributeError ('NoneType' object has no attribute
    # 'startswith'); an empty URL was taken as the file path "" and opened the current
    # directory as a SQLite file ("it is a directory"), or a JSON-lines log named "".
    with pytest.raises(ConfigurationError, match="store URL"):
        build(url)


@pytest.mark.parametrize("kind", ["journal", "checkpoints", "memory", "budget", "audit"])
def test_a_malformed_sqlite_url_is_refused_for_every_kind(kind: str) -> None:
    with pytest.raises(ConfigurationError, match="bad SQLite URL"):
        store_from_url(kind, "sqlite://journal.db")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["journal", "checkpoints", "memory", "budget", "audit"])
@pytest.mark.parametrize(
    "url", ["sqlite:journal.db", "sqlite:/srv/journal.db", "SQLite:x.db", "postgres:db-host/app"]
)
def test_a_scheme_without_its_slashes_is_not_taken_for_a_file_name(
    kind: str, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read as a bare path, "postgres:db-host/app" would be a SQLite file in the working
    # directory while its writer believes the journal is on a server.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match="lacks the '//' after its scheme"):
        store_from_url(kind, url)  # type: ignore[arg-type]
    setting = (
        "audit_url" if kind == "audit" else "budget_url" if kind == "budget" else "runtime_url"
    )
    with pytest.raises(ConfigurationError, match="lacks the '//' after its scheme"):
        Settings(**{setting: url})
    assert list(tmp_path.iterdir()) == []  # no file of that name was made


def test_the_refusal_of_a_postgres_url_without_slashes_shows_no_password() -> None:
    with pytest.raises(ConfigurationError) as raised:
        Settings(runtime_url="postgresql:app:hunter2@db/app")
    assert "hunter2" not in str(raised.value)
    assert "postgresql://user@host:5432/database" in str(raised.value)


def test_bare_paths_that_look_like_schemes_are_still_paths(tmp_path: Path) -> None:
    # A drive letter, or a file whose name merely starts with a scheme's letters.
    for url in ("C:/data/journal.db", "sqlite-journal.db", str(tmp_path / "postgres:x.db")):
        assert Settings(runtime_url=url).runtime_url == url


async def test_every_sqlite_store_reads_the_sqlite_settings(tmp_path: Path) -> None:
    settings = Settings(
        runtime_url=f"sqlite:///{tmp_path / 'journal.db'}",
        audit_url=f"sqlite:///{tmp_path / 'audit.db'}",
        budget_url=f"sqlite:///{tmp_path / 'budget.db'}",
        sqlite_busy_timeout_ms=1234,
        sqlite_synchronous="NORMAL",
    )
    async with Stores(settings) as stores:
        databases = [stores.database, getattr(stores.audit, "db", None), stores.budget.db]  # type: ignore[attr-defined]
        separate = store_from_url(
            "checkpoints", f"sqlite:///{tmp_path / 'c.db'}", settings=settings
        )
        databases.append(separate.db)
        for db in databases:
            assert isinstance(db, SqliteDatabase)
            assert (db.busy_timeout_ms, db.synchronous) == (1234, "NORMAL")


async def test_close_closes_every_store_and_raises_the_first_failure(tmp_path: Path) -> None:
    settings = Settings(
        runtime_url=f"sqlite:///{tmp_path / 'journal.db'}",
        budget_url=f"sqlite:///{tmp_path / 'budget.db'}",
    )
    stores = Stores(settings)
    await stores.migrate()
    budget = stores.budget
    assert isinstance(budget, SqlBudgetStore)
    database = stores.database
    assert database is not None

    class Broken(RuntimeError):
        pass

    async def broken_close() -> None:
        raise Broken("audit store would not close")

    stores.audit.close = broken_close  # type: ignore[method-assign]
    with pytest.raises(Broken):
        await stores.close()
    assert not budget.db.is_open  # built before the audit store, closed after it failed
    assert not database.is_open  # the journal, built first, closed last


async def test_a_store_without_auto_migrate_says_to_run_migrate_until_it_is_run(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    settings = Settings(runtime_url=url, auto_migrate=False)
    # The same lifecycle for every SQL store: a budget and an audit log on fresh databases.
    budget = SqlBudgetStore(f"sqlite:///{tmp_path / 'budget.db'}", settings=settings)
    audit = SqliteAuditStore(tmp_path / "audit.db", auto_migrate=False)
    try:
        with pytest.raises(MigrationError, match="loomflow migrate"):
            await budget.usage("ana")
        with pytest.raises(MigrationError, match="loomflow migrate"):
            await audit.open()
        assert not audit.ready
        await budget.migrate()
        await audit.migrate()
        assert await budget.usage("ana") == []
        await audit.open()
        assert audit.ready
    finally:
        await budget.close()
        await audit.close()
    assert not audit.ready


def test_the_composition_root_is_public() -> None:
    import loomflow
    import loomflow.stores

    assert loomflow.Stores is Stores
    names = list(loomflow.stores.__all__)
    assert names == sorted(names)
    assert all(getattr(loomflow.stores, name) is not None for name in names)


@pytest.mark.postgres
async def test_migrate_grants_the_app_role_once_per_postgresql_database(pg_dsn: str) -> None:
    import asyncpg
    from ulid import ULID

    role = f"loom_app_{str(ULID()).lower()}"
    try:
        async with Stores(Settings(runtime_url=pg_dsn)) as stores:
            report = await stores.migrate(app_role=role)
        # Journal, checkpoints, memory, budget and audit share one database: one grant.
        granted = [s for s in report.steps if s.store == "app role"]
        assert len(granted) == 1
        assert granted[0].message.startswith(f"app role {role} (created NOLOGIN):")
        assert report.app_role_granted
        conn = await asyncpg.connect(pg_dsn)
        try:
            rows = await conn.fetch(
                "SELECT privilege_type FROM information_schema.role_table_grants "
                "WHERE grantee = $1 AND table_name = 'loom_audit'",
                role,
            )
        finally:
            await conn.close()
        assert sorted(r[0] for r in rows) == ["INSERT", "SELECT"]  # append-only for the app
    finally:
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute(
                f"DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN "
                f'DROP OWNED BY "{role}"; DROP ROLE "{role}"; END IF; END $$'
            )
        finally:
            await conn.close()


async def test_an_app_role_on_sqlite_is_refused_before_anything_is_migrated(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "j.db"
    async with Stores(Settings(runtime_url=f"sqlite:///{journal}")) as stores:
        assert not stores.on_postgres()
        with pytest.raises(UserError, match="PostgreSQL"):
            await stores.migrate(app_role="loom_app")
    assert not journal.exists()  # refused before the journal was even opened
