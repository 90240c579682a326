"""PostgreSQL roles: ``loomflow migrate --app-role`` makes the audit log append-only for the app.

The tables' owner (and any superuser) can switch triggers off, so the guarantee rests on the
application connecting as another role. These tests make that role with the CLI, run an agent
through it, and try every way of erasing history it might have.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from ulid import ULID

from loomflow import Agent, ToolCall, Tuning, tool
from loomflow.audit import AuditRecord, PostgresAuditStore
from loomflow.config import Settings
from loomflow.errors import StoreUnavailableError, UserError
from loomflow.memory import memory_for
from loomflow.models import ScriptedModel
from loomflow.runtime import PostgresRuntime
from loomflow.storage import PostgresDatabase, grant_app_role

pytestmark = pytest.mark.postgres


def _as(dsn: str, role: str) -> str:
    """``dsn`` with ``role`` as the user (trust authentication lets any role connect)."""
    scheme, _, rest = dsn.partition("://")
    return f"{scheme}://{role}@{rest.partition('@')[2]}"


def _run(dsn: str, *statements: str) -> None:
    async def execute() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, execute()).result()


@pytest.fixture
def app_role(pg_dsn: str) -> Iterator[str]:
    """A role name, dropped (with its grants) after the test; roles are cluster-wide."""
    name = f"loom_app_{str(ULID()).lower()}"
    yield name
    _run(
        pg_dsn,
        f"DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{name}') THEN "
        f'DROP OWNED BY "{name}"; DROP ROLE "{name}"; END IF; END $$',
    )


def _migrate(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "migrate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**env, "LOOMFLOW_RUNTIME_URL": dsn},
    )


@tool
def lookup(order_id: str) -> str:
    """Look an order up."""
    return f"{order_id}: shipped"


@pytest.fixture
def app_dsn(pg_dsn: str, app_role: str) -> str:
    """The database migrated by the superuser, and a DSN of the app role granted with the CLI."""
    _run(pg_dsn, f'CREATE ROLE "{app_role}" LOGIN')
    done = _migrate(pg_dsn, "--app-role", app_role)
    assert done.returncode == 0, done.stderr
    assert f"app role {app_role}:" in done.stdout
    assert "append-only" in done.stdout
    return _as(pg_dsn, app_role)


async def test_the_agent_works_through_the_app_role_without_a_warning(
    app_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="loomflow.audit")
    runtime = await PostgresRuntime.connect(app_dsn)  # auto-migration on: nothing to do
    memory = memory_for(runtime)
    model = ScriptedModel(
        [[ToolCall(id="c1", name="lookup", arguments={"order_id": "A-1"})], "A-1 has shipped."]
    )
    async with Agent.from_settings(
        "Support.",
        model=model,
        tools=[lookup],
        settings=Settings(runtime_url=app_dsn),
        runtime=runtime,
        memory=memory,
        tuning=Tuning(checkpoint=True),
    ) as agent:
        result = await agent.run("Where is A-1?", session_id="t-1", user_id="ana")
        assert result.output == "A-1 has shipped."
        assert await agent.list_checkpoints("t-1", user_id="ana")
        assert await memory.episodes("t-1", user_id="ana")
        audit = agent.audit
        assert audit is not None
        report = await audit.verify()
        assert report.ok, report.problems
        assert report.entries >= 5
        usage = await agent.budget.store.usage("ana")  # type: ignore[union-attr]
        assert usage
    # Ordinary deletes on the other stores are the app's to make.
    assert await runtime.prune(user_id="ana", include_open=True) > 0
    await runtime.close()
    assert "least-privilege" not in caplog.text


async def test_the_app_role_cannot_erase_or_fork_the_trail(pg_dsn: str, app_dsn: str) -> None:
    store = PostgresAuditStore(app_dsn)
    await store.append([AuditRecord(user_id="alice", actor="t", action="x") for _ in range(3)])
    first = (await store.query(user_id="alice", limit=1)).entries[0]
    await store.close()
    conn = await asyncpg.connect(app_dsn)
    try:
        for sql in (
            "UPDATE loom_audit SET payload = '{}'",
            "DELETE FROM loom_audit",
            "TRUNCATE loom_audit",
            "ALTER TABLE loom_audit DISABLE TRIGGER USER",
            "ALTER TABLE loom_audit DISABLE TRIGGER ALL",
            "DROP TABLE loom_audit",
            "DROP TRIGGER loom_audit_no_delete ON loom_audit",
            "DROP TRIGGER loom_audit_erase_only ON loom_audit",
            # Erasing a payload is the one UPDATE the trigger lets through: not for this role.
            "UPDATE loom_audit SET payload = 'null', payload_salt = NULL",
            "DROP FUNCTION loom_audit_chain() CASCADE",
            "CREATE TRIGGER t BEFORE INSERT ON loom_audit FOR EACH ROW "
            "EXECUTE FUNCTION loom_audit_refuse()",
            "UPDATE loom_audit_heads SET seq = seq + 10",
            "DELETE FROM loom_audit_heads",
            "INSERT INTO loom_audit_heads VALUES ('\"zed\"', 'zed', 5, 'x')",
            "TRUNCATE loom_audit_heads",
            "ALTER TABLE loom_audit_heads DISABLE TRIGGER USER",
            "SET session_replication_role = replica",
            "DELETE FROM loom_schema_version",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(sql)
        # Inserting stays possible, but only an entry that extends the chain's head.
        columns = (
            "user_key, user_id, seq, time_us, actor, action, payload, schema_version, "
            "prev_hash, hash"
        )
        for seq, prev in ((2, first.hash), (4, "0" * 64), (1, "0" * 64)):
            with pytest.raises(asyncpg.IntegrityConstraintViolationError):
                await conn.execute(
                    f"INSERT INTO loom_audit ({columns}) VALUES "
                    "('\"alice\"', 'alice', $1, 0, 't', 'x', '{}', 1, $2, 'f')",
                    seq,
                    prev,
                )
        assert await conn.fetchval("SELECT count(*) FROM loom_audit") == 3
        assert await conn.fetchval("SELECT seq FROM loom_audit_heads") == 3
    finally:
        await conn.close()
    owner = PostgresAuditStore(pg_dsn)
    assert (await owner.verify()).ok
    await owner.close()


async def test_an_owner_can_erase_a_trail_which_only_saved_heads_reveal(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Why the app must not run as the owner: the triggers are the owner's to switch off."""
    caplog.set_level(logging.WARNING, logger="loomflow.audit")
    store = PostgresAuditStore(pg_dsn)
    await store.append([AuditRecord(user_id=u, actor="t", action="x") for u in ("ann", "bob")])
    assert "is a superuser" in caplog.text  # the start-up warning
    saved = (await store.verify()).heads
    _run(
        pg_dsn,
        "ALTER TABLE loom_audit DISABLE TRIGGER USER",
        "ALTER TABLE loom_audit_heads DISABLE TRIGGER USER",
        "DELETE FROM loom_audit WHERE user_id = 'bob'",
        "DELETE FROM loom_audit_heads WHERE user_id = 'bob'",
        "ALTER TABLE loom_audit ENABLE TRIGGER USER",
        "ALTER TABLE loom_audit_heads ENABLE TRIGGER USER",
    )
    assert (await store.verify()).ok  # nothing left in the store says bob existed
    report = await store.verify(heads=saved)
    assert [(p.user_id, p.kind) for p in report.problems] == [("bob", "truncated")]
    await store.close()


async def test_migrate_creates_a_missing_role_nologin_and_refuses_owners(
    pg_dsn: str, app_role: str, tmp_path: Path
) -> None:
    done = _migrate(pg_dsn, "--app-role", app_role)
    assert done.returncode == 0, done.stderr
    assert "(created NOLOGIN)" in done.stdout
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert (
            await conn.fetchval("SELECT rolcanlogin FROM pg_roles WHERE rolname = $1", app_role)
            is False
        )
        privileges = await conn.fetch(
            "SELECT table_name, string_agg(privilege_type, ',' ORDER BY privilege_type) "
            "FROM information_schema.role_table_grants WHERE grantee = $1 GROUP BY table_name",
            app_role,
        )
    finally:
        await conn.close()
    granted = {str(r[0]): str(r[1]) for r in privileges}
    assert granted["loom_audit"] == "INSERT,SELECT"
    assert granted["loom_audit_heads"] == "SELECT"
    assert granted["loom_schema_version"] == "SELECT"
    assert granted["loom_entries"] == "DELETE,INSERT,SELECT,UPDATE"
    db = PostgresDatabase(pg_dsn)
    try:
        _run(pg_dsn, f'CREATE ROLE "{app_role}_su" SUPERUSER')
        try:
            with pytest.raises(UserError, match="superuser"):
                await grant_app_role(db, f"{app_role}_su")
        finally:
            _run(pg_dsn, f'DROP ROLE "{app_role}_su"')
        # A member of the owning role can act as the owner (ALTER TABLE ... DISABLE TRIGGER).
        _run(pg_dsn, f'CREATE ROLE "{app_role}_m" LOGIN IN ROLE postgres')
        try:
            with pytest.raises(UserError, match="member of the owner"):
                await grant_app_role(db, f"{app_role}_m")
        finally:
            _run(pg_dsn, f'DROP ROLE "{app_role}_m"')
        with pytest.raises(UserError, match="running the migrations"):
            me = (await db.fetch("SELECT current_user"))[0][0]
            await grant_app_role(db, str(me))
    finally:
        await db.close()
    sqlite = _migrate(f"sqlite:///{tmp_path / 'journal.db'}", "--app-role", app_role)
    assert sqlite.returncode == 2
    assert "--app-role needs a PostgreSQL database" in sqlite.stderr


async def test_app_login_gives_an_existing_nologin_role_login(pg_dsn: str, app_role: str) -> None:
    async def can_login() -> bool:
        conn = await asyncpg.connect(pg_dsn)
        try:
            found = await conn.fetchval(
                "SELECT rolcanlogin FROM pg_roles WHERE rolname = $1", app_role
            )
        finally:
            await conn.close()
        return bool(found)

    _run(pg_dsn, f'CREATE ROLE "{app_role}" NOLOGIN')
    done = await asyncio.to_thread(_migrate, pg_dsn, "--app-role", app_role, "--app-login")
    assert done.returncode == 0, done.stderr
    assert f"app role {app_role} (existing role given LOGIN: set its password):" in done.stdout
    assert await can_login()
    # Asked again, or without --app-login, the role keeps LOGIN and nothing more is said.
    for extra in (["--app-login"], []):
        again = await asyncio.to_thread(_migrate, pg_dsn, "--app-role", app_role, *extra)
        assert again.returncode == 0, again.stderr
        assert f"app role {app_role}: " in again.stdout
        assert await can_login()


async def test_a_store_error_names_the_refusal(app_dsn: str) -> None:
    store = PostgresAuditStore(app_dsn)
    await store.append(AuditRecord(user_id="alice", actor="t", action="x"))
    with pytest.raises(StoreUnavailableError, match="permission denied"):
        await store.db.execute("DELETE FROM loom_audit")
    await store.close()


def _audit_cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "audit", "--audit-url", dsn, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


async def test_reading_the_trail_as_the_owner_warns_of_nothing_writing_does(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The warning is for an application writing as a role that can switch the triggers off:
    a compliance team reading the trail (query, show, export, verify) can do nothing about
    that, and retention and erasure must run as the owner."""
    caplog.set_level(logging.WARNING, logger="loomflow.audit")
    store = PostgresAuditStore(pg_dsn)
    try:
        await store.open()
        assert (await store.verify()).ok
        assert (await store.query()).entries == []
        assert "switch the append-only triggers off" not in caplog.text
        await store.append(AuditRecord(user_id="ann", actor="t", action="x"))
        assert "is a superuser" in caplog.text
    finally:
        await store.close()
    # A new process, so nothing was warned of yet: the read-only commands stay quiet.
    for command in (
        ("query",),
        ("export", "-o", str(tmp_path / "out.jsonl"), "--no-progress"),
        ("verify", "--no-progress"),
        ("retain", "--older-than", "365d", "--dry-run"),
        ("retain", "--older-than", "365d", "--yes"),
    ):
        done = _audit_cli(pg_dsn, *command)
        assert done.returncode == 0, (command, done.stderr)
        assert "triggers off" not in done.stderr, command


@pytest.mark.parametrize(
    "role",
    ["pg_monitor", "pg_read_all_data", "pg_write_all_data", "pg_my_app", "PG_Monitor", "public",
     "PUBLIC", "none", "current_user", "Session_User", " app", "app\n", "app\u202e", "   "],
)  # fmt: skip
async def test_migrate_refuses_a_reserved_or_unsafe_role_name_before_migrating(
    pg_dsn: str, role: str
) -> None:
    # pg_monitor exists and is no superuser: every member of it was given write access to
    # the tables; a new pg_* name failed with the driver's error after the migrations ran.
    refused = await asyncio.to_thread(_migrate, pg_dsn, "--app-role", role)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.startswith("loomflow: error: --app-role: ")
    assert "reserved PostgreSQL role name" in refused.stderr or "bad role name" in refused.stderr
    assert "\n" not in refused.stderr.rstrip("\n")
    assert refused.stdout == ""  # nothing was migrated
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT to_regclass('loom_entries')") is None
    finally:
        await conn.close()
    # Through the API too, after the migrations: nothing is granted to the name.
    assert (await asyncio.to_thread(_migrate, pg_dsn)).returncode == 0
    db = PostgresDatabase(pg_dsn)
    try:
        with pytest.raises(UserError, match=r"reserved PostgreSQL role name|bad role name"):
            await grant_app_role(db, role)
        granted = await db.fetch(
            "SELECT 1 FROM information_schema.role_table_grants "
            "WHERE grantee = $1 AND table_name LIKE 'loom%'",
            role,
        )
    finally:
        await db.close()
    assert granted == []


@pytest.mark.parametrize(
    ("attributes", "refusal"),
    [("CREATEROLE", "CREATEROLE"), ("IN ROLE pg_write_all_data", "pg_write_all_data")],
)
async def test_migrate_refuses_an_existing_role_that_could_write_past_its_grants(
    pg_dsn: str, app_role: str, attributes: str, refusal: str
) -> None:
    # Granted as asked, a role in pg_write_all_data kept UPDATE on loom_audit (and so could
    # erase payloads without an erasure record); one with CREATEROLE could, before
    # PostgreSQL 16, make itself a member of a non-superuser owner and switch triggers off.
    _run(pg_dsn, f'CREATE ROLE "{app_role}" LOGIN {attributes}')
    refused = await asyncio.to_thread(_migrate, pg_dsn, "--app-role", app_role)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refusal in refused.stderr
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert await _loom_grants(pg_dsn, app_role) == []


async def _loom_grants(dsn: str, role: str) -> list[asyncpg.Record]:
    """What ``role`` was granted on loomflow's tables."""
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(
            "SELECT 1 FROM information_schema.role_table_grants "
            "WHERE grantee = $1 AND table_name LIKE 'loom%'",
            role,
        )
    finally:
        await conn.close()


@pytest.mark.parametrize("power", ["SUPERUSER", "CREATEROLE"])
async def test_migrate_refuses_a_role_that_is_a_member_of_a_superuser_or_createrole_role(
    pg_dsn: str, app_role: str, power: str
) -> None:
    # The role's own attributes were checked, not those of the roles it belongs to: a member
    # of a superuser role (not the tables' owner) can SET ROLE to it and switch triggers off.
    _run(
        pg_dsn,
        f'CREATE ROLE "{app_role}_p" NOLOGIN {power}',
        f'CREATE ROLE "{app_role}" LOGIN IN ROLE "{app_role}_p"',
    )
    try:
        refused = await asyncio.to_thread(_migrate, pg_dsn, "--app-role", app_role)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"member of {app_role}_p" in refused.stderr
        assert power in refused.stderr.upper()
        assert await _loom_grants(pg_dsn, app_role) == []
    finally:
        _run(pg_dsn, f'DROP ROLE "{app_role}_p"')  # the fixture drops the role itself


async def test_the_app_role_gets_checkpoints_and_memory_when_nothing_else_shares_the_database(
    pg_dsn: str, app_role: str, tmp_path: Path
) -> None:
    # The grant ran right after the journal's migration; the checkpoint and memory tables,
    # made next, were granted only when the budget or the audit log lived in that database
    # too, so with neither the application's role could not write them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    env |= {"LOOMFLOW_RUNTIME_URL": pg_dsn, "LOOMFLOW_BUDGET_URL": "memory://",
            "LOOMFLOW_AUDIT_URL": str(tmp_path / "audit.jsonl")}  # fmt: skip
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "loomflow.cli", "migrate", "--app-role", app_role],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # No claim about an audit log the role's grants do not reach (it is a JSON-lines file).
    assert "app role" in done.stdout
    assert "append-only" not in done.stdout
    conn = await asyncpg.connect(pg_dsn)
    try:
        missing = await conn.fetch(
            "SELECT relname FROM pg_class WHERE relname LIKE 'loom%' AND relkind = 'r' "
            "AND relname <> 'loom_schema_version' "
            "AND NOT has_table_privilege($1, oid, 'INSERT')",
            app_role,
        )
    finally:
        await conn.close()
    assert [r[0] for r in missing] == []


def test_the_app_role_migrating_an_upgraded_schema_says_to_migrate_as_the_owner(
    pg_dsn: str, app_role: str
) -> None:
    """An application left on ``LOOMFLOW_AUTO_MIGRATE=true`` under the least-privilege role
    meets a release with a new migration: it cannot apply it. That is no outage to retry
    (``StoreUnavailableError: must be owner of table``) but a deploy step not yet run."""
    from loomflow.errors import MigrationError
    from loomflow.runtime.migrations import MIGRATIONS
    from loomflow.storage import Migration, apply_migrations

    assert _migrate(pg_dsn, "--app-role", app_role, "--app-login").returncode == 0
    upgraded = (
        *MIGRATIONS,
        Migration("a new column", ("ALTER TABLE loom_sessions ADD COLUMN x TEXT",)),
    )

    async def open_as_app() -> None:
        db = PostgresDatabase(_as(pg_dsn, app_role))
        await db.open()
        try:
            await apply_migrations(db, "journal", upgraded)
        finally:
            await db.close()

    with pytest.raises(MigrationError) as caught:
        asyncio.run(open_as_app())
    message = str(caught.value)
    assert "must be owner of table loom_sessions" in message
    assert f"role {app_role!r} may not change" in message
    assert "`loomflow migrate` as the role that owns them" in message
    assert "LOOMFLOW_AUTO_MIGRATE=false" in message


def test_the_app_role_is_granted_the_tables_the_search_path_finds(
    pg_dsn: str, app_role: str
) -> None:
    """With ``search_path=app2,app`` and the tables in ``app``, migrate finds and checks them
    there; ``--app-role`` said there were no loomflow tables in ``app2`` and to run the
    migrations first, which had just run."""
    _run(pg_dsn, "CREATE SCHEMA app", "CREATE SCHEMA app2")
    assert _migrate(f"{pg_dsn}?options=-c%20search_path%3Dapp").returncode == 0
    both = f"{pg_dsn}?options=-c%20search_path%3Dapp2,app"
    done = _migrate(both, "--app-role", app_role, "--app-login")
    assert done.returncode == 0, done.stderr
    _run(_as(both, app_role), "SELECT count(*) FROM loom_sessions")
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        _run(_as(both, app_role), "DELETE FROM loom_audit")
