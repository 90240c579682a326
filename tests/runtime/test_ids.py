"""The id rule (loomflow._ids): one check, the same refusal on every backend and every store."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow import MAX_ID_BYTES, InvalidIdError, UserError, check_id
from loomflow.audit import AuditLog, InMemoryAuditStore, audit_store_beside
from loomflow.checkpoints import checkpoint_store_for
from loomflow.config import Settings
from loomflow.governance import Cap, InMemoryBudgetStore, StandardBudget
from loomflow.governance.budget import budget_store_for
from loomflow.memory import memory_for
from loomflow.runtime import JournalRuntime
from loomflow.stores import Stores

Factory = Callable[..., Awaitable[JournalRuntime]]

LONG = "u" * 3000  # the length that used to fail only on PostgreSQL, as an index error

BAD_IDS = [
    pytest.param("", "must not be empty", id="empty"),
    pytest.param(LONG, "3000 bytes long in UTF-8, over the 256-byte limit", id="3000-chars"),
    pytest.param("é" * 129, "258 bytes long", id="258-utf8-bytes"),
    pytest.param("a\x00b", "U+0000 (NUL", id="nul"),
    pytest.param("a\nb", "U+000A", id="newline"),
    pytest.param("a\x85b", "U+0085", id="c1-control"),
    pytest.param("a\ud800", "lone surrogate", id="surrogate"),
]


def test_the_rule_itself() -> None:
    assert check_id("user_id", None) is None
    assert check_id("user_id", "x" * MAX_ID_BYTES) == "x" * MAX_ID_BYTES
    assert check_id("user_id", "José Ñandú 🚀 \u200b") is not None  # printable or format: fine
    with pytest.raises(InvalidIdError, match="user_id must not be empty") as info:
        check_id("user_id", "")
    assert info.value.field == "user_id"
    assert isinstance(info.value, UserError)
    with pytest.raises(InvalidIdError, match="session_id must be a non-empty string, not None"):
        check_id("session_id", None, optional=False)
    with pytest.raises(InvalidIdError, match="must be a string, not int"):
        check_id("session_id", 7)


@pytest.mark.parametrize(("bad", "reason"), BAD_IDS)
async def test_journal_refuses_bad_ids_before_touching_the_store(
    runtime_factory: Factory, bad: str, reason: str
) -> None:
    runtime = await runtime_factory()
    calls: list[int] = []
    for session_id, user_id, field in ((bad, "ana", "session_id"), ("s", bad, "user_id")):
        with pytest.raises(InvalidIdError, match=f"{field} .*{re.escape(reason)}") as info:
            async with runtime.session(session_id, user_id):
                calls.append(1)
        assert info.value.field == field
    async with runtime.session("s", "ana"):
        # Nested, the same rule holds (it used to become the sub-run "run:").
        with pytest.raises(InvalidIdError, match="session_id"):
            async with runtime.session(bad, "ana"):
                calls.append(1)
    assert calls == []
    assert [(s.session_id, s.user_id) for s in await runtime.sessions()] == [("s", "ana")]


@pytest.mark.parametrize(("bad", "reason"), BAD_IDS)
async def test_an_agent_name_follows_the_rule(
    runtime_factory: Factory, bad: str, reason: str
) -> None:
    # Each run journals its agent's name for recovery. A NUL or a lone surrogate in it used to
    # fail the first run (StoreUnavailableError on PostgreSQL, a bare UnicodeEncodeError on
    # SQLite); an empty or 3,000-byte name was journaled with every run.
    from loomflow import Agent
    from loomflow.models import ScriptedModel

    runtime = await runtime_factory()
    with pytest.raises(InvalidIdError, match=f"name .*{re.escape(reason)}") as info:
        Agent("x", model=ScriptedModel(["ok"]), runtime=runtime, name=bad)
    assert info.value.field == "name"
    agent = Agent("x", model=ScriptedModel(["ok"]), runtime=runtime, name="orders")
    with pytest.raises(InvalidIdError, match="name"):
        agent.clone(name=bad)
    assert (await agent.run("go", session_id="s")).output == "ok"


@pytest.mark.parametrize("key", ["", "k\x00", "k" * 2049], ids=["empty", "nul", "2049-bytes"])
async def test_idempotency_keys_follow_the_rule_with_a_longer_limit(
    runtime_factory: Factory, key: str
) -> None:
    runtime = await runtime_factory()
    calls: list[int] = []
    async with runtime.session("s", "ana"):
        with pytest.raises(InvalidIdError, match="idempotency_key"):
            await runtime.step("pay", lambda: calls.append(1), idempotency_key=key)
    assert calls == []


async def test_an_id_at_the_limit_of_quotes_fits_every_index(runtime_factory: Factory) -> None:
    # The worst case for the JSON-encoded keys: every character escaped. On PostgreSQL this
    # goes through every btree index of the journal, checkpoints, memory, audit and budget.
    worst = '"' * MAX_ID_BYTES
    runtime = await runtime_factory()
    stores = _stores(runtime)
    async with runtime.session(worst, worst) as run:
        await runtime.step("a", lambda: 1)
        await runtime.step("b", lambda: 2, idempotency_key=worst * 4)
        async with runtime.session(worst, worst):  # a sub-run: the path repeats the session id
            await runtime.step("c", lambda: 3)
    assert run.stats.misses == 3
    memory = stores["memory"]
    await memory.record_episode(
        worst, user_id=worst, key=f'["{worst}","{worst}","epoch",0]', messages=[], output="o"
    )
    assert len(await memory.episodes(worst, user_id=worst)) == 1
    await stores["audit"].record("run.start", user_id=worst, actor="a", session_id=worst)
    assert (await stores["audit"].verify(user_id=worst)).ok
    assert len(await stores["budget"].status(worst)) == 1
    await stores["budget"].close()


@pytest.mark.parametrize(("bad", "reason"), BAD_IDS[:4])
async def test_every_store_refuses_bad_ids_the_same_way(
    runtime_factory: Factory, bad: str, reason: str
) -> None:
    runtime = await runtime_factory()
    await runtime.open()
    stores = _stores(runtime)
    checkpoints, memory, audit, budget = (
        stores["checkpoints"],
        stores["memory"],
        stores["audit"],
        stores["budget"],
    )
    attempts: list[Callable[[], Awaitable[Any]]] = [
        lambda: checkpoints.latest(bad, user_id="ana"),
        lambda: checkpoints.list_checkpoints("s", user_id=bad),
        lambda: memory.episodes(bad, user_id="ana"),
        lambda: memory.remember("fact", "is", "x", user_id=bad),
        lambda: memory.record_episode("s", user_id=bad, key="k", messages=[], output=""),
        lambda: audit.record("run.start", user_id=bad, actor="agent:a"),
        lambda: audit.record("run.start", user_id="ana", actor="agent:a", session_id=bad),
        lambda: audit.record("run.start", user_id="ana", actor="agent:a", run_id=bad),
        lambda: budget.status(bad),
    ]
    for attempt in attempts:
        with pytest.raises(InvalidIdError, match=re.escape(reason)):
            await attempt()
    with pytest.raises(InvalidIdError, match=re.escape(reason)):
        await audit.query(user_id=bad)  # reads follow the id rule too
    assert (await audit.query()).entries == []  # and nothing was written
    await budget.close()


def _stores(runtime: JournalRuntime) -> dict[str, Any]:
    database = getattr(runtime, "database", None)
    caps = [Cap("tokens_total", 1000)]
    budget_store = budget_store_for(Settings(), database) if database else None
    return {
        "checkpoints": checkpoint_store_for(runtime),
        "memory": memory_for(runtime),
        "audit": AuditLog(audit_store_beside(database) if database else InMemoryAuditStore()),
        "budget": StandardBudget(caps, store=budget_store or InMemoryBudgetStore()),
    }


async def test_deep_nesting_under_long_ids_is_refused_before_the_database(
    runtime_factory: Factory,
) -> None:
    # Each nested session repeats the session id in the sub-run path; with ids of 256 escaped
    # characters the third level would overflow PostgreSQL's btree entry. It is refused by the
    # journal, with the step's name, on every backend alike.
    worst = '"' * MAX_ID_BYTES
    runtime = await runtime_factory()
    ran: list[int] = []
    level = [runtime.session(worst, worst) for _ in range(4)]
    async with level[0], level[1], level[2]:
        await runtime.step("level_2", lambda: ran.append(2))
        async with level[3]:
            with pytest.raises(UserError, match=r"step 'level_3': its journal key .* over"):
                await runtime.step("level_3", lambda: ran.append(3))
    assert ran == [2]


async def test_a_second_runtime_object_on_the_journal_joins_the_open_run(
    runtime_factory: Factory,
) -> None:
    first = await runtime_factory(turn_timeout=0.5)
    second = await runtime_factory(turn_timeout=0.5)
    async with first.session("s", "u") as run:
        await first.step("outer", lambda: 1)
        async with second.session("s", "u") as inner:  # used to wait for its own turn
            assert inner is run
            assert second.current_run is run
            await second.step("inner", lambda: 2)
    assert {(e.path, e.name) for e in await first.entries("s", "u")} == {
        ((), "outer"),
        (("run:s#0",), "inner"),
    }
    # Outside any run the second runtime still has none of its own.
    assert second.current_run is None


@pytest.mark.postgres
async def test_postgres_identity_falls_back_when_the_control_data_is_refused(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loomflow.runtime import PostgresRuntime, _identity

    # Managed services may revoke pg_control_system(); the server's start time stands in.
    monkeypatch.setattr(_identity, "_PG_IDENTITY", "SELECT * FROM pg_control_system_denied()")
    first, second = PostgresRuntime(pg_dsn), PostgresRuntime(pg_dsn)
    try:
        await first.open()
        assert await _identity.journal_identity(first) == await _identity.journal_identity(second)
        async with first.session("s", "u"), second.session("s", "u") as inner:
            await second.step("inner", lambda: 1)
        assert inner.stats.misses == 1
    finally:
        await first.close()
        await second.close()


@pytest.mark.parametrize(("bad", "reason"), BAD_IDS)
async def test_listing_and_pruning_refuse_bad_ids_by_name(
    runtime_factory: Factory, bad: str, reason: str
) -> None:
    # They took any value (entries too): a lone surrogate was the driver's UnicodeEncodeError
    # on SQLite, and an empty, NUL or 3000-byte id a listing of nothing or a prune of nothing.
    runtime = await runtime_factory()
    async with runtime.session("s", "ana"):
        await runtime.step("a", lambda: 1)
    for field, call in (
        ("user_id", lambda: runtime.sessions(user_id=bad)),
        ("session_id", lambda: runtime.sessions(session_id=bad)),
        ("user_id", lambda: runtime.prune(user_id=bad, include_open=True)),
        ("session_id", lambda: runtime.prune(session_id=bad, include_open=True)),
        # `runs show` reads these: a lone surrogate was the driver's UnicodeEncodeError.
        ("session_id", lambda: runtime.entries(bad, "ana")),
        ("user_id", lambda: runtime.entries("s", bad)),
    ):
        with pytest.raises(InvalidIdError, match=f"{field} .*{re.escape(reason)}"):
            await call()
    async with Stores(Settings(runtime_url="memory://")) as stores:
        with pytest.raises(InvalidIdError, match=f"user_id .*{re.escape(reason)}"):
            await stores.export_user(bad)
    assert [s.user_id for s in await runtime.sessions(user_id="ana")] == ["ana"]
    assert len(await runtime.entries("s", "ana")) == 1


async def test_entries_refuse_an_id_that_is_not_text(runtime_factory: Factory) -> None:
    # It was json's TypeError ("Object of type bytes is not JSON serializable").
    runtime = await runtime_factory()
    for session_id, user_id, field in ((b"s", "ana", "session_id"), ("s", b"ana", "user_id")):
        with pytest.raises(InvalidIdError, match=f"{field} must be a string, not bytes"):
            await runtime.entries(session_id, user_id)  # type: ignore[arg-type]
