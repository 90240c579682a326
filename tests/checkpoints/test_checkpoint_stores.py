"""Checkpoint stores beyond the conformance suite: construction, sharing, migrations, damage."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path

import pytest

from loomflow.agent import Agent, Tuning
from loomflow.checkpoints import (
    InMemoryCheckpointStore,
    PostgresCheckpointStore,
    SqlCheckpointStore,
    SqliteCheckpointStore,
    checkpoint_store_for,
    checkpoint_store_from_url,
)
from loomflow.checkpoints.migrations import SCHEMA_VERSION
from loomflow.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigurationError,
    InvalidArgumentError,
    InvalidIdError,
    MigrationError,
    SessionExistsError,
    StoreUnavailableError,
    UserError,
)
from loomflow.hooks import RunHooks, RunInfo
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import InMemoryRuntime, PostgresRuntime, SqliteRuntime
from loomflow.storage import schema_versions
from loomflow.testing.checkpoint_conformance import Shop, checkpoint


def shopping_agent(runtime: object, shop: Shop, **tuning: object) -> Agent:
    return Agent(
        "You shop.",
        model=shop.model,
        tools=[shop.tool],
        runtime=runtime,  # type: ignore[arg-type]
        tuning=Tuning(checkpoint=True, **tuning),  # type: ignore[arg-type]
    )


async def test_urls_name_their_backend(tmp_path: Path) -> None:
    assert isinstance(checkpoint_store_from_url("memory://"), InMemoryCheckpointStore)
    store = checkpoint_store_from_url(f"sqlite:///{tmp_path / 'c.db'}")
    assert isinstance(store, SqlCheckpointStore)
    assert store.backend == "sqlite"
    await store.put(checkpoint())
    await store.close()
    assert (tmp_path / "c.db").exists()
    assert checkpoint_store_from_url("postgresql://u@h/db").backend == "postgres"
    with pytest.raises(ConfigurationError, match="scheme"):
        checkpoint_store_from_url("mysql://u@h/db")


async def test_a_store_beside_a_runtime_shares_its_connection(sqlite_path: Path) -> None:
    runtime = SqliteRuntime(sqlite_path)
    store = checkpoint_store_for(runtime)
    assert isinstance(store, SqlCheckpointStore)
    assert store.db is runtime.database
    assert checkpoint_store_for(runtime) is store  # one store per connection
    await store.put(checkpoint())
    await store.close()  # the runtime's connection is not the store's to close
    assert runtime.database.is_open
    async with runtime.session("s", "u"):
        assert await runtime.step("a", lambda: 1) == 1
    assert await store.latest("s", user_id="u") is not None
    await runtime.close()
    with sqlite3.connect(sqlite_path) as conn:  # the journal file holds the checkpoints
        assert conn.execute("SELECT COUNT(*) FROM loom_checkpoints").fetchone() == (1,)


def test_only_journaled_runtimes_have_a_store_beside_them() -> None:
    class Homemade:
        backend = "custom"

    with pytest.raises(UserError, match="journal"):
        checkpoint_store_for(Homemade())
    memory = InMemoryRuntime()
    assert isinstance(checkpoint_store_for(memory), InMemoryCheckpointStore)


async def test_migrations_are_recorded_once_per_component(sqlite_path: Path) -> None:
    stores = [SqliteCheckpointStore(sqlite_path, auto_migrate=False) for _ in range(4)]
    assert await asyncio.gather(*(s.migrate() for s in stores)) == [SCHEMA_VERSION] * 4
    for store in stores:
        await store.close()
    with sqlite3.connect(sqlite_path) as conn:
        rows = conn.execute(
            "SELECT version FROM loom_schema_version WHERE component = 'checkpoints'"
        ).fetchall()
    assert rows == [(v,) for v in range(1, SCHEMA_VERSION + 1)]


async def test_without_auto_migrate_the_table_must_be_migrated_first(sqlite_path: Path) -> None:
    runtime = SqliteRuntime(sqlite_path, auto_migrate=False)
    await runtime.migrate()
    store = checkpoint_store_for(runtime)
    with pytest.raises(
        MigrationError, match=r"checkpoints schema is at version 0.*loomflow migrate"
    ):
        await store.put(checkpoint())
    assert await store.migrate() == SCHEMA_VERSION
    await store.put(checkpoint())
    assert await store.latest("s", user_id="u") is not None
    await runtime.close()


async def _damage(path: Path, sql: str) -> None:
    def run() -> None:
        with sqlite3.connect(path) as conn:
            conn.execute(sql)

    await asyncio.to_thread(run)


async def test_a_damaged_checkpoint_is_a_typed_error(sqlite_path: Path) -> None:
    store = SqliteCheckpointStore(sqlite_path)
    await store.put(checkpoint())
    await _damage(sqlite_path, "UPDATE loom_checkpoints SET messages = X'7b6e6f74'")
    with pytest.raises(CheckpointError, match="cannot be decoded"):
        await store.latest("s", user_id="u")
    await _damage(sqlite_path, "UPDATE loom_checkpoints SET messages = X'5b5d', codec_version = 99")
    with pytest.raises(CheckpointError, match="newer"):
        await store.latest("s", user_id="u")
    await _damage(
        sqlite_path, "UPDATE loom_checkpoints SET messages = X'5b315d', codec_version = 1"
    )
    with pytest.raises(CheckpointError, match="transcript"):
        await store.latest("s", user_id="u")
    await store.close()


async def test_resume_falls_back_to_the_journal_when_the_snapshot_is_damaged(
    sqlite_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = SqliteRuntime(sqlite_path)
    shop = Shop(fail_at=2)
    agent = shopping_agent(runtime, shop)
    with pytest.raises(ConnectionError):
        await agent.run("shop", session_id="s", user_id="u")
    await _damage(sqlite_path, "UPDATE loom_checkpoints SET messages = X'00'")
    with caplog.at_level(logging.WARNING, logger="loomflow.agent"):
        result = await agent.resume("shop", session_id="s", user_id="u")
    assert result.restored_from is None
    assert result.replayed_steps == 4  # the journal walk: two model calls, two tool calls
    assert shop.bought == ["apples", "bread", "cheese"]
    assert "replaying the journal" in caplog.text
    await runtime.close()


async def test_strict_replay_refuses_a_damaged_snapshot(sqlite_path: Path) -> None:
    runtime = SqliteRuntime(sqlite_path)
    agent = shopping_agent(runtime, Shop(), strict_replay=True)
    await agent.run("shop", session_id="s", user_id="u")
    await _damage(sqlite_path, "UPDATE loom_checkpoints SET messages = X'00'")
    with pytest.raises(CheckpointError):
        await agent.resume("shop", session_id="s", user_id="u")
    await runtime.close()


async def test_misuse_is_a_user_error() -> None:
    shop = Shop()
    without_runtime = shopping_agent(None, shop)
    with pytest.raises(UserError, match="journaled runtime"):
        await without_runtime.run("shop")
    with pytest.raises(UserError, match="without a runtime"):
        await without_runtime.list_checkpoints("s")
    plain = Agent("x", model=shop.model, tools=[shop.tool], runtime=InMemoryRuntime())
    with pytest.raises(UserError, match="checkpoint=True"):
        await plain.resume("shop", session_id="s", from_checkpoint="x")
    with pytest.raises(UserError, match="from_checkpoint"):
        await plain.resume("shop", session_id="s", fork_session_id="f")
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        Tuning(checkpoint_retention=0)


async def test_a_retention_no_store_can_keep_is_refused_when_tuning_is_built() -> None:
    """Accepted by Tuning, a retention past 64 bits failed every run at its first snapshot,
    after the first tool call had run (and again on each resume)."""
    with pytest.raises(ValueError, match="less than or equal to"):
        Tuning(checkpoint_retention=2**63)
    assert Tuning(checkpoint_retention=2**63 - 1).checkpoint_retention == 2**63 - 1
    shop = Shop()
    agent = shopping_agent(InMemoryRuntime(), shop, checkpoint_retention=2**63 - 1)
    assert (await agent.run("shop", session_id="s", user_id="u")).output.startswith("bought:")


async def test_a_restored_run_keeps_its_instructions_and_calls_todays_tools(
    sqlite_path: Path,
) -> None:
    """As the checkpoints doc says: the snapshot's system prompt goes on, the agent's current
    tools answer, and a tool removed since is an error the model reads."""
    runtime = SqliteRuntime(sqlite_path)
    with pytest.raises(ConnectionError):
        await shopping_agent(runtime, Shop(fail_at=2)).run("shop", session_id="s", user_id="u")
    seen: list[tuple[str, list[str]]] = []

    def decide(messages: list[Message], tools: list[ToolSpec]) -> object:
        seen.append((messages[0].content, [t.name for t in tools]))
        return [ToolCall(id="x", name="buy", arguments={"item": "z"})] if len(seen) == 1 else "ok"

    changed = Agent(
        "New instructions.",
        model=FunctionModel(decide),
        runtime=runtime,
        tuning=Tuning(checkpoint=True),
    )
    result = await changed.resume("shop", session_id="s", user_id="u")
    assert result.restored_from is not None
    assert seen == [("You shop.", []), ("You shop.", [])]
    assert result.messages[-2].is_error
    assert "no tool named 'buy'" in result.messages[-2].content
    await runtime.close()


class _FailsToStart(RunHooks):
    """A hook whose store is down when the next run starts (an audit log, say)."""

    armed = False

    async def run_started(self, info: RunInfo) -> None:
        if self.armed:
            self.armed = False
            raise ConnectionError("the hook's store went away")


async def test_a_fork_that_fails_as_it_starts_resumes_from_the_fork_point(
    sqlite_path: Path,
) -> None:
    """The fork's session is claimed when its run opens; a run_started hook that raised
    before the fork's first snapshot left a session whose resume began the errand again from
    its prompt, buying what the source had bought, and which no fork could take any more."""
    runtime = SqliteRuntime(sqlite_path)
    shop, hook = Shop(), _FailsToStart()
    agent = Agent(
        "You shop.",
        model=shop.model,
        tools=[shop.tool],
        runtime=runtime,
        hooks=[hook],
        tuning=Tuning(checkpoint=True),
    )
    await agent.run("shop", session_id="s", user_id="u")
    [after_bread] = [c for c in await agent.list_checkpoints("s", user_id="u") if c.turn == 2]
    bought = list(shop.bought)
    hook.armed = True
    with pytest.raises(ConnectionError):
        await agent.resume(
            "shop", session_id="s", user_id="u", from_checkpoint=after_bread.id,
            fork_session_id="fork",
        )  # fmt: skip
    resumed = await agent.resume("shop", session_id="fork", user_id="u")
    assert resumed.restored_from is not None
    assert shop.bought == [*bought, "cheese"]  # only what comes after the fork point
    assert resumed.output == "bought: bought apples, bought bread, bought cheese"
    forked = await agent.list_checkpoints("fork", user_id="u")
    assert {c.parent_id for c in forked} == {after_bread.id}
    await runtime.close()


async def test_a_fork_whose_snapshots_are_gone_is_seeded_again_or_refused(
    sqlite_path: Path,
) -> None:
    """A fork's session without a snapshot (a crash between the fork's run opening and its
    first snapshot; here the rows are deleted) resumed from the prompt: the forked turns were
    lost and the errand began again. Its record names the checkpoint it forks."""
    runtime = SqliteRuntime(sqlite_path)
    shop = Shop()
    agent = shopping_agent(runtime, shop)
    await agent.run("shop", session_id="s", user_id="u")
    [after_bread] = [c for c in await agent.list_checkpoints("s", user_id="u") if c.turn == 2]
    await agent.resume(
        "shop", session_id="s", user_id="u", from_checkpoint=after_bread.id,
        fork_session_id="fork",
    )  # fmt: skip
    bought = list(shop.bought)
    # Without snapshots, continuing a fork would start it over: refused.
    plain = Agent("You shop.", model=shop.model, tools=[shop.tool], runtime=runtime)
    with pytest.raises(UserError, match="is a fork of checkpoint"):
        await plain.resume("shop", session_id="fork", user_id="u")
    with sqlite3.connect(sqlite_path) as db:
        db.execute("DELETE FROM loom_checkpoints WHERE session_id = 'fork'")
    db.close()
    resumed = await agent.resume("shop", session_id="fork", user_id="u")
    assert resumed.output == "bought: bought apples, bought bread, bought cheese"
    assert resumed.restored_from == after_bread.id
    assert shop.bought == bought  # replayed from the fork's journal: nothing bought again
    with sqlite3.connect(sqlite_path) as db:
        db.execute("DELETE FROM loom_checkpoints")
    db.close()
    with pytest.raises(CheckpointNotFoundError, match="stopped before its first snapshot"):
        await agent.resume("shop", session_id="fork", user_id="u")
    assert shop.bought == bought
    await runtime.close()


async def test_an_agent_inside_another_run_writes_no_checkpoints() -> None:
    runtime = InMemoryRuntime()
    shop = Shop()
    worker = shopping_agent(None, shop)
    worker.name = "worker"

    def lead(messages: list[Message], tools: list[ToolSpec]) -> object:
        if messages[-1].role == "tool":
            return messages[-1].content
        return [ToolCall(id="w", name="worker", arguments={"task": "shop"})]

    outer = Agent(
        "lead",
        model=FunctionModel(lead),  # type: ignore[arg-type]
        tools=[worker.as_tool()],
        runtime=runtime,
        tuning=Tuning(checkpoint=True),
    )
    result = await outer.run("go", session_id="s", user_id="u")
    assert result.output.startswith("bought: ")
    # Only the outer run's two passes: the worker shares its session, not its snapshots.
    assert [c.turn for c in await outer.list_checkpoints("s", user_id="u")] == [2, 1]


@pytest.mark.postgres
async def test_postgres_stores_from_a_dsn_or_a_pool(pg_dsn: str) -> None:
    import asyncpg

    owned = PostgresCheckpointStore(pg_dsn)
    await owned.put(checkpoint())
    await owned.close()
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    adopted = PostgresCheckpointStore(pool)
    assert await adopted.latest("s", user_id="u") is not None
    await adopted.close()
    assert await pool.fetchval("SELECT count(*) FROM loom_checkpoints") == 1  # pool still open
    await pool.close()
    runtime = await PostgresRuntime.connect(pg_dsn)
    store = checkpoint_store_for(runtime)
    assert isinstance(store, SqlCheckpointStore)
    assert store.db is runtime.database
    assert (await schema_versions(runtime.database))["checkpoints"] == SCHEMA_VERSION
    await runtime.close()


async def test_an_unreachable_database_is_a_store_error() -> None:
    store = PostgresCheckpointStore("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(StoreUnavailableError, match="connect"):
        await store.latest("s", user_id="u")


def test_public_names_are_exported_and_sorted() -> None:
    import loomflow.checkpoints
    import loomflow.memory

    for module in (loomflow.checkpoints, loomflow.memory):
        names = list(module.__all__)
        assert names == sorted(names), module.__name__
        for name in names:
            assert getattr(module, name) is not None


async def test_a_fork_refused_for_the_anonymous_user_names_them_so() -> None:
    # The refusal said "of user None", naming a user called None instead of the runs
    # without a user.
    runtime = InMemoryRuntime()
    agent = shopping_agent(runtime, Shop())
    await agent.run("shop", session_id="s", user_id="alice")
    alices = (await agent.list_checkpoints("s", user_id="alice"))[0].id
    with pytest.raises(CheckpointNotFoundError, match=r"of the anonymous user$"):
        await agent.resume("shop", session_id="s", from_checkpoint=alices)
    with pytest.raises(CheckpointNotFoundError, match=r"of user 'None'$"):
        await agent.resume("shop", session_id="s", user_id="None", from_checkpoint=alices)


async def _fork_all(agents: list[Agent], checkpoint_id: str, into: str) -> list[object]:
    """Every agent forks session "s" of user "u" from one checkpoint into ``into``, at once."""
    return await asyncio.gather(
        *(
            agent.resume(
                "shop",
                session_id="s",
                user_id="u",
                from_checkpoint=checkpoint_id,
                fork_session_id=into,
            )
            for agent in agents
        ),
        return_exceptions=True,
    )


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_concurrent_forks_into_one_new_session_id_fork_once(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Each fork checked that its fork_session_id had no runs before any of them had claimed
    # it, so on SQLite all three forked into one session: the tools ran three times, and the
    # session held three runs where the docs promise a refusal.
    if backend == "postgres":
        runtime: SqliteRuntime | PostgresRuntime = await PostgresRuntime.connect(
            request.getfixturevalue("pg_dsn")
        )
    else:
        runtime = SqliteRuntime(tmp_path / "journal.db")
    shop = Shop()
    agent = shopping_agent(runtime, shop)
    try:
        await agent.run("shop", session_id="s", user_id="u")
        first_pass = (await agent.list_checkpoints("s", user_id="u"))[-1]
        bought = len(shop.bought)
        outcomes = await _fork_all([agent] * 3, first_pass.id, "retry-1")
        forked = [o for o in outcomes if not isinstance(o, BaseException)]
        refused = [o for o in outcomes if isinstance(o, UserError)]
        assert len(forked) == 1
        assert len(refused) == 2
        assert all("already has runs" in str(o) for o in refused)
        assert shop.bought[bought:] == ["bread", "cheese"]  # the fork's turns, once
        [session] = await runtime.sessions(session_id="retry-1", user_id="u")
        assert session.epoch == 1  # one run
        from loomflow.agent._agent import _fork_locks

        assert _fork_locks[runtime] == {}  # fork session ids are new each time: none kept
    finally:
        await runtime.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_forks_from_two_workers_into_one_new_session_id_fork_once(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Two runtimes on one journal, as two processes have: the in-process fork lock does not
    # span them, so both checked the session was new and both claimed it; the second then
    # ran its fork on top of the first's session. The claim is now the check.
    async def open_runtime() -> SqliteRuntime | PostgresRuntime:
        if backend == "postgres":
            return await PostgresRuntime.connect(request.getfixturevalue("pg_dsn"))
        return SqliteRuntime(tmp_path / "journal.db")

    first, second = await open_runtime(), await open_runtime()
    shop = Shop()
    agents = [shopping_agent(first, shop), shopping_agent(second, shop)]
    try:
        await agents[0].run("shop", session_id="s", user_id="u")
        first_pass = (await agents[0].list_checkpoints("s", user_id="u"))[-1]
        bought = len(shop.bought)
        outcomes = await _fork_all(agents, first_pass.id, "retry-2")
        assert len([o for o in outcomes if not isinstance(o, BaseException)]) == 1, outcomes
        [refused] = [o for o in outcomes if isinstance(o, BaseException)]
        assert isinstance(refused, SessionExistsError), refused
        assert shop.bought[bought:] == ["bread", "cheese"]  # the fork's turns, once
        [session] = await first.sessions(session_id="retry-2", user_id="u")
        assert session.epoch == 1
    finally:
        await first.close()
        await second.close()


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("id", "a\x00b", InvalidIdError),
        ("id", "", InvalidIdError),
        ("run_id", "r" * 300, InvalidIdError),
        ("parent_id", "a\x00", InvalidIdError),
        ("prompt", "a\x00b", UserError),
        ("output", "a\x00", UserError),
        ("prompt", "a\ud800", UserError),  # a bare UnicodeEncodeError on SQLite
        ("epoch", 2**63, InvalidArgumentError),
        ("turn", 2**63, InvalidArgumentError),
        ("prompt_index", 2**63, InvalidArgumentError),
        ("cost_usd", float("inf"), InvalidArgumentError),
    ],
)
@pytest.mark.parametrize(
    "kind", ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_checkpoint_no_backend_can_keep_is_refused_by_name_before_the_write(
    kind: str,
    field: str,
    value: object,
    error: type[Exception],
    request: pytest.FixtureRequest,
    sqlite_path: Path,
) -> None:
    # PostgreSQL failed such a write as StoreUnavailableError (NUL, a number past its column),
    # SQLite on a number past 64 bits; the others kept what PostgreSQL could not.
    url = {"memory": "memory://", "sqlite": f"sqlite:///{sqlite_path}"}.get(kind)
    store = checkpoint_store_from_url(url or request.getfixturevalue("pg_dsn"))
    bad = checkpoint().model_copy(update={field: value})
    try:
        with pytest.raises(error, match=field):
            await store.put(bad)
        assert await store.list_checkpoints("s", user_id="u") == []
        await store.put(checkpoint())  # a sound one still goes in
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_resume_that_only_replays_a_finished_run_writes_no_checkpoints(
    kind: str, sqlite_path: Path, request: pytest.FixtureRequest
) -> None:
    """A retried resume of a run that finished before checkpoints were turned on replays every
    step from the journal: it writes nothing, snapshots included (it holds no turn, and a new
    run of the session may be writing its own snapshots, which the retention cut would drop)."""
    if kind == "sqlite":
        runtime: SqliteRuntime | PostgresRuntime = SqliteRuntime(sqlite_path)
    else:
        runtime = await PostgresRuntime.connect(request.getfixturevalue("pg_dsn"))
    shop = Shop()
    try:
        before = Agent("You shop.", model=shop.model, tools=[shop.tool], runtime=runtime)
        first = await before.run("shop", session_id="s", user_id="u")
        agent = shopping_agent(runtime, shop)
        again = await agent.resume("shop", session_id="s", user_id="u")
        assert again.output == first.output
        assert again.replayed_steps >= 7  # four model calls, three tool calls (and more)
        assert shop.bought == ["apples", "bread", "cheese"]
        assert await agent.list_checkpoints("s", user_id="u") == []
        # A later run of the session writes its own, as always.
        await agent.run("shop", session_id="s", user_id="u")
        assert len(await agent.list_checkpoints("s", user_id="u")) == 4
    finally:
        await runtime.close()
