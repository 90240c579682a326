"""One runtime, one ``asyncio.run()`` per task: the second task gets a connection of its own loop.

A script or a sync worker (a queue consumer, a view) often builds its agent at import and calls
``asyncio.run()`` per task. On SQLite that worked; on PostgreSQL the second task failed with a
bare ``RuntimeError: Event loop is closed`` from the first loop's pool. The pool of a loop that
no longer runs is now dropped and a new one made on the running loop; a pool whose loop still
runs in another thread is refused with a ``UserError`` instead of being used from two loops.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loomflow import Agent
from loomflow.errors import UserError
from loomflow.models import ScriptedModel
from loomflow.runtime import JournalRuntime, PostgresRuntime, SqliteRuntime


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def make_runtime(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[JournalRuntime]:
    if request.param == "sqlite":
        yield SqliteRuntime(tmp_path / "journal.db")
    else:
        yield PostgresRuntime(request.getfixturevalue("pg_dsn"))


def test_each_asyncio_run_gets_a_working_connection(make_runtime: JournalRuntime) -> None:
    runtime = make_runtime
    agent = Agent("x", model=ScriptedModel(["done"], default="done"), runtime=runtime)
    for task in range(3):  # a loop per task, as asyncio.run() makes one and closes it after
        result = asyncio.run(agent.run("hi", session_id=f"task-{task}", user_id="alice"))
        assert result.output == "done"

    async def listed() -> list[str]:
        try:
            return sorted(info.session_id for info in await runtime.sessions())
        finally:
            await runtime.close()

    assert asyncio.run(listed()) == ["task-0", "task-1", "task-2"]


@pytest.mark.postgres
def test_a_pool_in_use_by_a_loop_of_another_thread_is_refused(pg_dsn: str) -> None:
    runtime = PostgresRuntime(pg_dsn)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def one_step(session: str) -> str:
        async def body() -> str:
            return "ok"

        async with runtime.session(session, user_id="alice"):
            return await runtime.step("s", body)

    try:
        assert asyncio.run_coroutine_threadsafe(one_step("there"), loop).result(30) == "ok"
        with pytest.raises(UserError, match="running in another thread"):
            asyncio.run(one_step("here"))
        # The other thread's loop keeps its connection and goes on using it.
        assert asyncio.run_coroutine_threadsafe(one_step("there-2"), loop).result(30) == "ok"
    finally:
        asyncio.run_coroutine_threadsafe(runtime.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
