"""``Stores.forget_user`` and ``loomflow users forget|hold|release``, over real agent runs.

Each test runs a real agent (scripted model, real tools) for two users on SQLite files or a
PostgreSQL database, forgets one, and checks what every store still holds; the audit trail
must verify afterwards. A forget killed half-way (a real SIGKILL) leaves a state ``audit
verify`` accepts, and running it again finishes the work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import getpass
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from ulid import ULID

from loomflow import Agent, ToolCall, Tuning, tool
from loomflow.audit import AuditRecord
from loomflow.config import Settings
from loomflow.errors import (
    AuditIntegrityError,
    ErasureRefusedError,
    LegalHoldError,
    ProtectedChainError,
    SessionBusyError,
    UnknownUserError,
    UserError,
)
from loomflow.models import ScriptedModel
from loomflow.stores import Stores

LOGIN = getpass.getuser()

HERE = Path(__file__).resolve().parent
NAME = "Ana Lindqvist of flat 4B"  # personal data no redactor shape catches


@tool
def lookup(order_id: str) -> str:
    """Look an order up."""
    return f"{order_id}: shipped to {NAME}"


async def _runs(settings: Settings, *users: str) -> None:
    """One real agent run per user: journal, checkpoint, memory, budget and audit entries."""
    async with Stores(settings) as stores:
        for user in users:
            model = ScriptedModel(
                [
                    [ToolCall(id="c1", name="lookup", arguments={"order_id": "A-1"})],
                    f"A-1 has shipped to {NAME}.",
                ]
            )
            async with Agent.from_settings(
                "Support.",
                model=model,
                tools=[lookup],
                settings=settings,
                runtime=stores.runtime,
                memory=stores.memory,
                tuning=Tuning(checkpoint=True),
            ) as agent:
                result = await agent.run(
                    f"Where is A-1? I am {NAME}", session_id="t-1", user_id=user
                )
                assert result.output == f"A-1 has shipped to {NAME}."


def _settings(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Settings:
    if kind == "sqlite":
        return Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}")
    if kind == "sqlite+jsonl":
        return Settings(
            runtime_url=f"sqlite:///{tmp_path / 'journal.db'}",
            audit_url=f"jsonl:///{tmp_path / 'audit.jsonl'}",
        )
    return Settings(runtime_url=request.getfixturevalue("pg_dsn"))


def _has_data(document: dict[str, Any]) -> dict[str, int]:
    return {
        "entries": len(document["journal"]["entries"]),
        "checkpoints": len(document["checkpoints"].get("checkpoints", [])),
        "episodes": len(document["memory"].get("episodes", [])),
        "budget": len(document["budget"]),
    }


@pytest.mark.parametrize(
    "kind", ["sqlite", "sqlite+jsonl", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_forget_removes_the_user_from_every_store_and_the_trail_verifies(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    settings = _settings(kind, tmp_path, request)
    await _runs(settings, "ana", "bob")
    async with Stores(settings) as stores:
        before = await stores.export_user("ana")
        assert all(_has_data(before).values()), _has_data(before)
        assert NAME in json.dumps(before, ensure_ascii=False)
        heads = (await stores.audit.verify()).heads

        report = await stores.forget_user("ana", actor="test")
        assert report.journal > 0
        assert report.checkpoints > 0
        assert sum(report.memory.values()) > 0
        assert report.budget > 0
        assert report.audit_erased == len(before["audit"])

        after = await stores.export_user("ana")
        assert _has_data(after) == {"entries": 0, "checkpoints": 0, "episodes": 0, "budget": 0}
        assert after["journal"]["sessions"] == []  # no run holds them: the rows went too
        assert NAME not in json.dumps(after, ensure_ascii=False)
        # The trail is all there, payloads gone, and says what happened without saying who.
        trail = after["audit"]
        assert len(trail) == len(before["audit"]) + 1
        assert [e["payload"] for e in trail[:-1]] == [None] * len(before["audit"])
        record = trail[-1]
        assert record["action"] == "audit.erasure"
        assert record["actor"] == "test"
        assert record["payload"]["deleted"] == report.deleted()
        verified = await stores.audit.verify(heads=heads)
        assert verified.ok, verified.problems
        assert verified.erased == len(before["audit"])
        # Bob's data is untouched.
        bob = await stores.export_user("bob")
        assert all(_has_data(bob).values())
        assert all(e["payload"] is not None for e in bob["audit"])


async def test_forget_refuses_unknown_and_held_users_and_deletes_nothing(tmp_path: Path) -> None:
    settings = _settings("sqlite", tmp_path, pytest.FixtureRequest)  # type: ignore[arg-type]
    await _runs(settings, "ana")
    async with Stores(settings) as stores:
        with pytest.raises(UnknownUserError, match="'nobody'"):
            await stores.forget_user("nobody")
        assert await stores.audit.count(user_id="nobody") == 0
        await stores.audit.place_hold("ana", reason="litigation L-7", actor="legal:dana")
        with pytest.raises(LegalHoldError, match="litigation L-7") as caught:
            await stores.forget_user("ana")
        assert caught.value.user_id == "ana"
        kept = await stores.export_user("ana")
        assert all(_has_data(kept).values())
        assert await stores.audit.count(user_id="ana", action="audit.erasure") == 0
        await stores.audit.release_hold("ana", actor="legal:dana")
        assert (await stores.forget_user("ana")).journal > 0


@pytest.mark.parametrize(
    "kind", ["sqlite", "sqlite+jsonl", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_hold_keeps_a_user_from_every_deletion_and_deletions_are_noted(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    settings = _settings(kind, tmp_path, request)
    await _runs(settings, "ana", "bob")
    async with Stores(settings) as stores:
        await stores.audit.place_hold("ana", reason="litigation L-7", actor="legal:dana")
        with pytest.raises(LegalHoldError, match="litigation L-7"):
            await stores.forget_checkpoints("ana")
        with pytest.raises(LegalHoldError, match="litigation L-7"):
            await stores.prune_journal(user_id="ana")
        # A prune of everyone keeps everything of the held user, and deletes the rest.
        assert await stores.prune_journal(dry_run=True) == await stores.prune_journal()
        ana, bob = await stores.export_user("ana"), await stores.export_user("bob")
        assert _has_data(ana)["entries"] > 0
        assert _has_data(ana)["checkpoints"] > 0
        assert _has_data(bob)["entries"] == 0
        assert await stores.audit.count(user_id="ana", action="audit.deletion") == 0
        await stores.audit.release_hold("ana", actor="legal:dana")
        entries, snapshots = _has_data(ana)["entries"], _has_data(ana)["checkpoints"]
        assert await stores.prune_journal(user_id="ana", actor="ops:eve") == entries
        assert await stores.forget_checkpoints("ana", actor="ops:eve") == snapshots
        notes = [
            e for e in (await stores.export_user("ana"))["audit"] if e["action"] == "audit.deletion"
        ]
        assert [(n["actor"], n["payload"]["store"], n["payload"]["deleted"]) for n in notes] == [
            ("ops:eve", "journal", entries),
            ("ops:eve", "checkpoints", snapshots),
        ]
        assert NAME not in json.dumps(notes, ensure_ascii=False)
        # A deletion that finds nothing is not noted; the notes survive a forget.
        assert await stores.forget_checkpoints("ana") == 0
        assert await stores.audit.count(user_id="ana", action="audit.deletion") == 2
        await stores.forget_user("ana")
        after = [e for e in (await stores.export_user("ana"))["audit"]]
        assert [e["payload"]["store"] for e in after if e["action"] == "audit.deletion"] == [
            "journal",
            "checkpoints",
        ]
        assert (await stores.audit.verify()).ok


async def test_the_cli_refuses_to_delete_a_held_users_data(tmp_path: Path) -> None:
    env = {"LOOMFLOW_RUNTIME_URL": f"sqlite:///{tmp_path / 'journal.db'}"}
    await _runs(Settings(runtime_url=env["LOOMFLOW_RUNTIME_URL"]), "ana")
    assert _cli(env, "users", "hold", "ana", "--reason", "subpoena 14").returncode == 0
    for command in (
        ["checkpoints", "forget", "--user", "ana", "--yes"],
        ["journal", "prune", "--user", "ana"],
    ):
        done = _cli(env, *command)
        assert done.returncode == 1, done
        assert "under legal hold" in done.stderr
        assert "subpoena 14" in done.stderr
    done = _cli(env, "journal", "prune", "--all", "--json")
    assert json.loads(done.stdout) == {"deleted": 0}
    assert _cli(env, "users", "release", "ana").returncode == 0
    done = _cli(env, "checkpoints", "forget", "--user", "ana", "--yes", "--json")
    assert json.loads(done.stdout)["deleted"] > 0
    trail = _cli(env, "audit", "query", "--user", "ana", "--action", "audit.deletion", "--json")
    [note] = json.loads(trail.stdout)["entries"]
    assert (note["actor"], note["payload"]["store"]) == (f"cli:{LOGIN}", "checkpoints")
    # Who placed and lifted the hold, and who erased the user, is the person at the terminal
    # (as for runs cancel and approvals), not the name of the command.
    assert _cli(env, "users", "forget", "ana", "--yes").returncode == 0
    trail = _cli(env, "audit", "query", "--user", "ana", "--json")
    actors = {e["action"]: e["actor"] for e in json.loads(trail.stdout)["entries"]}
    for action in ("legal_hold.placed", "legal_hold.released", "audit.erasure"):
        assert actors[action] == f"cli:{LOGIN}", (action, actors)


# -- the least-privilege role on PostgreSQL ---------------------------------------------------


def _as(dsn: str, role: str) -> str:
    scheme, _, rest = dsn.partition("://")
    return f"{scheme}://{role}@{rest.partition('@')[2]}"


def _sql(dsn: str, *statements: str) -> None:
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
    name = f"loom_app_{str(ULID()).lower()}"
    yield name
    _sql(
        pg_dsn,
        f"DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{name}') THEN "
        f'DROP OWNED BY "{name}"; DROP ROLE "{name}"; END IF; END $$',
    )


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**clean, **env},
    )


@pytest.mark.postgres
async def test_the_app_role_cannot_forget_and_the_owner_can(pg_dsn: str, app_role: str) -> None:
    _sql(pg_dsn, f'CREATE ROLE "{app_role}" LOGIN')
    migrated = _cli({"LOOMFLOW_RUNTIME_URL": pg_dsn}, "migrate", "--app-role", app_role)
    assert migrated.returncode == 0, migrated.stderr
    app = Settings(runtime_url=_as(pg_dsn, app_role))
    await _runs(app, "ana")  # the application works through its role
    async with Stores(app) as stores:
        with pytest.raises(ErasureRefusedError, match=f"role '{app_role}' may not erase"):
            await stores.forget_user("ana")
        # Refused before anything was deleted, in any store.
        assert all(_has_data(await stores.export_user("ana")).values())
        # Nor can it erase payloads by hand, the one UPDATE the trigger lets through.
        audit = stores.audit
        with pytest.raises(ErasureRefusedError):
            await audit._tombstone('"ana"', 10**6, None, [])
        # Holds are appended entries: the role can place and release them.
        await audit.place_hold("ana", reason="audit request", actor="app")
        await audit.release_hold("ana", actor="app")
    done = _cli({"LOOMFLOW_RUNTIME_URL": _as(pg_dsn, app_role)}, "users", "forget", "ana", "--yes")
    assert done.returncode == 1
    assert "may not erase audit payloads" in done.stderr
    done = _cli({"LOOMFLOW_RUNTIME_URL": pg_dsn}, "users", "forget", "ana", "--yes")
    assert done.returncode == 0, done.stderr
    verify = _cli({"LOOMFLOW_RUNTIME_URL": pg_dsn}, "audit", "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "payloads erased, on record" in verify.stdout


# -- a forget killed half-way -----------------------------------------------------------------


def _forget_killed_at(env: dict[str, str], where: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    return subprocess.run(
        [sys.executable, str(HERE / "_forget_worker.py"), "ana", where],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**clean, **env},
    )


def _leftovers(folder: Path) -> list[Path]:
    return list(folder.glob("audit.jsonl.*.erase"))


@pytest.mark.parametrize(("audit", "where"), [("sqlite", "tombstone"), ("jsonl", "rename")])
async def test_a_forget_killed_half_way_verifies_and_a_rerun_completes(
    tmp_path: Path, audit: str, where: str
) -> None:
    env = {"LOOMFLOW_RUNTIME_URL": f"sqlite:///{tmp_path / 'journal.db'}"}
    if audit == "jsonl":
        env["LOOMFLOW_AUDIT_URL"] = f"jsonl:///{tmp_path / 'audit.jsonl'}"
    settings = Settings(
        runtime_url=env["LOOMFLOW_RUNTIME_URL"], audit_url=env.get("LOOMFLOW_AUDIT_URL")
    )
    await _runs(settings, "ana", "bob")
    killed = _forget_killed_at(env, where)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    stored = tmp_path / ("audit.jsonl" if audit == "jsonl" else "journal.db")
    assert NAME in stored.read_bytes().decode(
        "utf-8", "replace"
    )  # the payloads were not yet erased

    verify = _cli(env, "audit", "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    again = _cli(env, "users", "forget", "ana", "--yes", "--json")
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["journal"] == 0  # the killed run deleted these already
    assert report["audit_erased"] > 0
    verify = _cli(env, "audit", "verify", "--json")
    assert verify.returncode == 0, verify.stdout
    assert json.loads(verify.stdout)["erased"] == report["audit_erased"]
    async with Stores(settings) as stores:
        trail = (await stores.export_user("ana"))["audit"]
        assert [e["action"] for e in trail[-2:]] == ["audit.erasure", "audit.erasure"]
        assert NAME not in json.dumps(trail, ensure_ascii=False)
        assert (await stores.audit.verify()).ok
    if audit == "sqlite":
        with sqlite3.connect(stored) as conn:
            rows = conn.execute("SELECT payload FROM loom_audit WHERE user_id = 'ana'").fetchall()
        assert all(NAME not in r[0] for r in rows)
    else:
        assert _leftovers(tmp_path) == []  # the killed run's rewritten copy is gone
        lines = [json.loads(x) for x in stored.read_text(encoding="utf-8").splitlines()]
        assert all(NAME not in json.dumps(x) for x in lines if x["user_id"] == "ana")


# -- the command line -------------------------------------------------------------------------


async def test_console_chains_are_not_forgotten_and_a_held_one_blocks_the_forget(
    tmp_path: Path,
) -> None:
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}")
    await _runs(settings, "ana")
    async with Stores(settings) as stores:
        look = AuditRecord(
            user_id="console:ops",
            actor="console:ops",
            action="console.query",
            payload={"query": "trail", "viewed_user": "ana"},
        )
        await stores.audit._write(look)
        with pytest.raises(ProtectedChainError, match="console chain") as refused:
            await stores.forget_user("console:ops")
        assert refused.value.user_id == "console:ops"
        await stores.audit.place_hold("console:ops", reason="inquiry into who looked")
        before = await stores.export_user("ana")
        with pytest.raises(LegalHoldError, match="console:ops"):
            await stores.forget_user("ana")
        after = await stores.export_user("ana")
        assert _has_data(after) == _has_data(before)  # nothing deleted anywhere
        assert after["audit"] == before["audit"]
        await stores.audit.release_hold("console:ops")
        report = await stores.forget_user("ana")
        assert report.console_erased == 1
        assert (await stores.audit.verify()).ok


async def test_the_cli_holds_releases_and_forgets(tmp_path: Path) -> None:
    env = {"LOOMFLOW_RUNTIME_URL": f"sqlite:///{tmp_path / 'journal.db'}"}
    await _runs(Settings(runtime_url=env["LOOMFLOW_RUNTIME_URL"]), "ana")

    done = _cli(env, "users", "forget", "ana")
    assert done.returncode == 2
    assert "pass --yes" in done.stderr
    done = _cli(env, "users", "hold", "ana", "--reason", "subpoena 14")
    assert done.returncode == 0, done.stderr
    assert "under legal hold" in done.stdout
    done = _cli(env, "users", "holds", "--json")  # JSON Lines, as every listing
    assert [(h["user_id"], h["reason"]) for h in map(json.loads, done.stdout.splitlines())] == [
        ("ana", "subpoena 14")
    ]
    # A reason or id that would drive the terminal or forge a row is shown escaped.
    done = _cli(env, "users", "hold", "b\u202eob", "--reason", "\x1b[2Jwiped\nforged row")
    assert done.returncode == 0, done.stderr
    table = _cli(env, "users", "holds").stdout.splitlines()
    assert table[0].split() == ["user", "placed", "(UTC)", "by", "reason"]
    assert len(table) == 3  # the header and two holds: no forged row
    assert "\x1b" not in "".join(table)
    assert "\u202e" not in "".join(table)
    assert r"\x1b[2Jwiped\nforged row" in table[2] or r"\x1b[2Jwiped\nforged row" in table[1]
    refused = _cli(env, "users", "forget", "b\u202eob", "--yes")
    assert refused.returncode == 1
    assert len(refused.stderr.splitlines()) == 1
    assert "\x1b" not in refused.stderr
    assert _cli(env, "users", "release", "b\u202eob").returncode == 0
    done = _cli(env, "users", "hold", "ana", "--reason", "again")
    assert done.returncode == 1
    assert "already under legal hold" in done.stderr
    done = _cli(env, "users", "forget", "ana", "--yes")
    assert done.returncode == 1
    assert "under legal hold" in done.stderr
    assert "subpoena 14" in done.stderr
    done = _cli(env, "audit", "retain", "--older-than", "1d")
    assert done.returncode == 2
    done = _cli(env, "audit", "retain", "--older-than", "1s", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    retained = json.loads(done.stdout)
    assert (retained["erased"], retained["held"]) == ([], ["ana"])  # old enough, but held
    done = _cli(env, "audit", "retain", "--older-than", "0s", "--yes")
    assert done.returncode == 2  # zero is not an age: bad usage, naming the option
    assert "--older-than" in done.stderr
    assert "is no age" in done.stderr
    done = _cli(env, "users", "release", "ana", "--reason", "case closed")
    assert done.returncode == 0, done.stderr
    done = _cli(env, "audit", "retain", "--older-than", "1s", "--yes")
    assert done.returncode == 0, done.stderr
    assert "erased " in done.stdout
    assert "of 1 user(s)" in done.stdout
    done = _cli(env, "users", "release", "ana")
    assert done.returncode == 1
    assert "not under legal hold" in done.stderr
    done = _cli(env, "users", "forget", "nobody", "--yes")
    assert done.returncode == 1
    assert "no store holds anything about user 'nobody'" in done.stderr
    done = _cli(env, "users", "forget", "ana", "--yes")
    assert done.returncode == 0, done.stderr
    assert "forgot user 'ana'" in done.stdout
    done = _cli(env, "audit", "query", "--user", "ana")
    assert "[payload erased]" in done.stdout
    done = _cli(env, "audit", "retain", "--older-than", "1d", "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["erased"] == []
    done = _cli(env, "audit", "verify")
    assert done.returncode == 0, done.stdout


async def test_an_in_memory_journal_forgets_a_user_and_keeps_the_others() -> None:
    from loomflow.runtime import InMemoryRuntime

    runtime = InMemoryRuntime()
    for user in ("ana", "bob"):
        model = ScriptedModel(
            [[ToolCall(id="c1", name="lookup", arguments={"order_id": "A-1"})], "Shipped."]
        )
        async with Agent("Support.", model=model, tools=[lookup], runtime=runtime) as agent:
            await agent.run("Where is A-1?", session_id="t-1", user_id=user)
    assert await runtime.entries("t-1", "ana")
    deleted = await runtime.forget_user("ana")
    assert deleted > 1
    assert await runtime.sessions(user_id="ana") == []
    assert await runtime.entries("t-1", "ana") == []
    assert [s.user_id for s in await runtime.sessions()] == ["bob"]
    assert await runtime.forget_user("ana") == 0
    with pytest.raises(UserError, match="user_id"):
        await runtime.forget_user("")


async def test_a_forget_erases_the_console_looks_that_name_the_user_and_no_others(
    tmp_path: Path,
) -> None:
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}")
    looks: list[dict[str, Any]] = [
        {"query": "trail", "viewed_user": "alice"},
        {"query": "trail", "viewed_user": "al"},
        {"query": "users", "details": {"search": "ALICE"}},  # the search is case-blind
        {"query": "users", "details": {"search": "ali"}},  # names nobody in particular
        {"query": "users", "details": {"search": "alice@corp.com"}},  # another user's id
        {"query": "trail", "viewed_user": "bob", "details": {"session": "alice-s1"}},  # bob's
        {"query": "users", "details": {"search": ""}},
    ]
    async with Stores(settings) as stores:
        for user in ("al", "alice", "admin", "users", "bob"):
            await stores.audit.append(
                AuditRecord(user_id=user, actor="agent:x", action="tool.call", payload={"n": 1})
            )
        await stores.audit._write(
            [
                AuditRecord(
                    user_id="console:ops",
                    actor="console:ops",
                    action="console.query",
                    payload={"role": "admin", "via": "token", **look},
                )
                for look in looks
            ]
        )

        async def erased() -> list[int]:
            chain = [e async for e in stores.audit.entries(user_id="console:ops")]
            return [e.seq for e in chain if e.payload is None]

        # Neither a prefix of a longer id, nor the entries' own words (a role, a query).
        for user in ("al", "admin", "users"):
            await stores.forget_user(user)
        assert await erased() == [2]
        report = await stores.forget_user("alice")
        assert report.console_erased == 2
        assert await erased() == [1, 2, 3]
        assert (await stores.audit.verify()).ok


async def test_another_users_damaged_head_row_does_not_stop_a_forget(tmp_path: Path) -> None:
    # The forget looked for console chains through every head, and one head row edited by
    # hand (text in bob's seq) made `users forget ana` fail, naming nobody: another user's
    # damage held up an erasure request. A console chain that names ana and whose head is
    # damaged still stops it, by name, before anything is deleted.
    settings = _settings("sqlite", tmp_path, pytest.FixtureRequest)  # type: ignore[arg-type]
    await _runs(settings, "ana", "bob", "cy")
    async with Stores(settings) as stores:
        await stores.audit._write(
            AuditRecord(
                user_id="console:ops",
                actor="console:ops",
                action="console.query",
                payload={"query": "trail", "viewed_user": "cy"},
            )
        )
    with sqlite3.connect(tmp_path / "journal.db") as conn:
        conn.execute("DROP TRIGGER IF EXISTS loom_audit_heads_forward")
        conn.execute("""UPDATE loom_audit_heads SET seq = 'x' WHERE user_key = '"bob"'""")
        conn.execute("""UPDATE loom_audit_heads SET seq = 'y' WHERE user_key = '"console:ops"'""")
    conn.close()
    env = {"LOOMFLOW_RUNTIME_URL": f"sqlite:///{tmp_path / 'journal.db'}"}
    done = _cli(env, "users", "forget", "ana", "--yes")
    assert done.returncode == 0, done.stderr
    assert "forgot user 'ana'" in done.stdout
    refused = _cli(env, "users", "forget", "cy", "--yes")
    assert refused.returncode == 1
    assert "the console chain 'console:ops' names user 'cy'" in refused.stderr
    assert "seq is 'y', not a whole number" in refused.stderr
    async with Stores(settings) as stores:
        assert stores.runtime is not None
        assert await stores.runtime.sessions(user_id="cy")  # nothing of cy's deleted
        assert not await stores.runtime.sessions(user_id="ana")


async def test_the_anonymous_user_is_not_everyone_in_the_budget(tmp_path: Path) -> None:
    # budget.usage(None) lists every bucket of every user: the anonymous user's export carried
    # the others' totals, and a forget of an anonymous bucket that held nothing "succeeded".
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}")
    await _runs(settings, "ana")
    async with Stores(settings) as stores:
        assert (await stores.export_user("ana"))["budget"]
        assert (await stores.export_user(None))["budget"] == []
        with pytest.raises(UnknownUserError, match="about the anonymous user"):
            await stores.forget_user(None)
        assert await stores.audit.head(None) is None  # the refusal wrote no trail for None


@pytest.mark.parametrize("damage", ["seq = 'four'", "hash_version = 'x'"])
async def test_a_damaged_trail_stops_a_forget_before_anything_is_deleted(
    tmp_path: Path, damage: str
) -> None:
    settings = _settings("sqlite", tmp_path, pytest.FixtureRequest)  # type: ignore[arg-type]
    await _runs(settings, "ana")
    with sqlite3.connect(tmp_path / "journal.db") as conn:
        conn.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
        conn.execute(f"UPDATE loom_audit SET {damage} WHERE user_id = 'ana' AND seq = 2")
    conn.close()
    async with Stores(settings) as stores:
        with pytest.raises(AuditIntegrityError, match="stopped before deleting anything"):
            await stores.forget_user("ana")
        # Every store still holds the user: the forget can be run again once repaired.
        assert stores.runtime is not None
        assert stores.checkpoints is not None
        assert await stores.runtime.sessions(user_id="ana")
        assert await stores.checkpoints.list_checkpoints("t-1", user_id="ana")
        assert await stores.audit.count(user_id="ana", action="audit.erasure") == 0
    env = {"LOOMFLOW_RUNTIME_URL": f"sqlite:///{tmp_path / 'journal.db'}"}
    done = _cli(env, "users", "forget", "ana", "--yes")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert "stopped before deleting anything" in done.stderr


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_forget_is_refused_while_a_run_of_the_user_is_in_progress(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A run in progress would write its snapshots, episode, budget and audit entries back
    after the erasure (with the prompt it was given before it): forget refuses, deletes
    nothing, and works once the run is over. So does a forget of the user's checkpoints
    alone (the API's and the CLI's, from another process): the run's next snapshot would be
    back a turn after the deletion."""
    settings = _settings(kind, tmp_path, request)
    await _runs(settings, "bob")  # the stores exist
    started, release = asyncio.Event(), asyncio.Event()

    @tool
    async def slow(order_id: str) -> str:
        """Look an order up, slowly."""
        started.set()
        await release.wait()
        return f"{order_id}: shipped to {NAME}"

    async with Stores(settings) as stores:
        model = ScriptedModel(  # the first pass ends (a snapshot), the second waits
            [
                [ToolCall(id="c0", name="lookup", arguments={"order_id": "A-0"})],
                [ToolCall(id="c1", name="slow", arguments={"order_id": "A-1"})],
                "Shipped.",
            ]
        )
        async with Agent.from_settings(
            "Support.", model=model, tools=[lookup, slow], settings=settings,
            runtime=stores.runtime, memory=stores.memory, tuning=Tuning(checkpoint=True),
        ) as agent:  # fmt: skip
            run = asyncio.create_task(
                agent.run(f"Where is A-1? I am {NAME}", session_id="t-1", user_id="ana")
            )
            await asyncio.wait_for(started.wait(), 30)
            before = _has_data(await stores.export_user("ana"))
            assert before["checkpoints"] > 0
            with pytest.raises(SessionBusyError, match="'t-1'"):
                await stores.forget_user("ana", actor="test")
            with pytest.raises(SessionBusyError, match="'t-1'"):
                await stores.forget_checkpoints("ana", actor="test")
            if kind == "sqlite":
                env = {"LOOMFLOW_RUNTIME_URL": settings.runtime_url}
                done = await asyncio.to_thread(
                    _cli, env, "checkpoints", "forget", "--user", "ana", "--yes"
                )
                assert done.returncode == 1, done
                assert "has a run in progress (session 't-1')" in done.stderr
            assert _has_data(await stores.export_user("ana")) == before  # nothing deleted
            release.set()
            assert (await run).output == "Shipped."
        report = await stores.forget_user("ana", actor="test")
        assert report.journal > 0
        after = await stores.export_user("ana")
        assert _has_data(after) == {"entries": 0, "checkpoints": 0, "episodes": 0, "budget": 0}
        assert NAME not in json.dumps(after, ensure_ascii=False)


_DIES_IN_A_MODEL_CALL = """
import asyncio, sys, time
from loomflow import Agent, Tuning
from loomflow.config import Settings
from loomflow.governance import Cap
from loomflow.messages import ModelResponse
from loomflow.models import FunctionModel

def decide(messages, tools):
    print("calling", flush=True)
    time.sleep(120)  # killed here
    return ModelResponse(text="never")

async def main():
    async with Agent.from_settings(
        "Support.", model=FunctionModel(decide, name="m"), caps=[Cap("tokens_total", 10**6)],
        settings=Settings(), tuning=Tuning(checkpoint=True, max_tokens=64),
    ) as agent:
        await agent.run(sys.argv[1], session_id="t-dead", user_id="ana")

asyncio.run(main())
"""


def _kill_during_a_model_call(runtime_url: str) -> None:
    """Start a worker that runs ana's agent, and SIGKILL it inside the model call."""
    env = {**os.environ, "LOOMFLOW_RUNTIME_URL": runtime_url}
    child = subprocess.Popen(
        [sys.executable, "-c", _DIES_IN_A_MODEL_CALL, f"Where is A-1? I am {NAME}"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "calling"
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_forget_of_a_user_whose_worker_died_mid_run_leaves_nothing_behind(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A worker killed during a model call leaves its session row (holding the run's prompt)
    leased and a budget hold on the user's bucket. The run is in progress for nobody, so the
    forget goes ahead, and it must take both: nothing of the user is left for `budget reclaim`
    or a recovery worker to bring back."""
    settings = _settings(kind, tmp_path, request)
    await _runs(settings, "bob")  # the stores exist, and someone else's data to keep
    _kill_during_a_model_call(settings.runtime_url)
    async with Stores(settings) as stores:
        before = await stores.export_user("ana")
        assert before["journal"]["sessions"][0]["state"] == "orphaned"
        await stores.forget_user("ana", actor="test")
        assert await stores.budget.reclaim() == 0  # the hold named only ana's bucket
        after = await stores.export_user("ana")
        assert after["journal"]["sessions"] == []
        assert after["budget"] == []
        assert NAME not in json.dumps(after, ensure_ascii=False)
        assert not [r for r in await stores.budget.reservations() if "ana" in str(r.buckets)]
        assert _has_data(await stores.export_user("bob"))["entries"] > 0
        assert (await stores.audit.verify()).ok


@pytest.mark.parametrize("cut", ["middle", "tail"])
async def test_a_jsonl_trail_that_refuses_appends_stops_a_forget_before_anything_is_deleted(
    tmp_path: Path, cut: str
) -> None:
    # A JSON-lines log refuses appends to a trail it finds damaged (lines deleted behind its
    # back). The forget's erasure record is such an append: the journal, checkpoints and
    # memory were emptied first, and then the forget failed with no record of it anywhere.
    settings = _settings("sqlite+jsonl", tmp_path, pytest.FixtureRequest)  # type: ignore[arg-type]
    await _runs(settings, "ana", "bob")
    log = tmp_path / "audit.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    ana = [i for i, line in enumerate(lines) if json.loads(line)["user_id"] == "ana"]
    del lines[ana[-1] if cut == "tail" else ana[1]]
    log.write_bytes(b"".join(lines))
    async with Stores(settings) as stores:
        with pytest.raises(AuditIntegrityError, match="stopped before deleting anything"):
            await stores.forget_user("ana")
        assert stores.runtime is not None
        assert stores.checkpoints is not None
        assert await stores.runtime.sessions(user_id="ana")
        assert await stores.checkpoints.list_checkpoints("t-1", user_id="ana")
        # Everyone else is forgotten as before.
        report = await stores.forget_user("bob")
        assert report.audit_record_seq is not None
        assert not await stores.runtime.sessions(user_id="bob")


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_payload_erased_behind_every_record_stops_a_forget_and_a_retention(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # A payload set to null in the database, with no erasure record: verify reports it, but
    # a forget (or a retention) then wrote a record that covered it, and the trail verified
    # again, the unrecorded erasure gone from view.
    settings = _settings(kind, tmp_path, request)
    await _runs(settings, "ana", "bob")
    blank = (
        "UPDATE loom_audit SET payload = 'null', payload_salt = NULL "
        "WHERE user_id = 'ana' AND seq = 2"
    )
    if kind == "sqlite":
        with sqlite3.connect(tmp_path / "journal.db") as conn:
            conn.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
            conn.execute(blank)
        conn.close()
    else:
        _sql(settings.runtime_url, "SET session_replication_role = replica", blank)
    async with Stores(settings) as stores:
        assert [(p.kind, p.seq) for p in (await stores.audit.verify(user_id="ana")).problems] == [
            ("erased", 2)
        ]
        with pytest.raises(
            AuditIntegrityError, match=r"no erasure record that covers them \(seq 2\)"
        ):
            await stores.forget_user("ana")
        assert stores.runtime is not None
        assert await stores.runtime.sessions(user_id="ana")
        report = await stores.audit.retain(dt.timedelta(microseconds=1), actor="cron")
        assert list(report.refused) == ["ana"]
        assert "bob" in report.erased
        after = await stores.audit.verify()
        assert [(p.user_id, p.kind, p.seq) for p in after.problems] == [("ana", "erased", 2)]
        assert await stores.audit.count(user_id="ana", action="audit.erasure") == 0
