"""Leases under stress: stopped and forked workers, paused SQLite writers, failed releases.

Everything here is real: processes are forked, stopped and killed with signals, SQLite locks
are held by other processes, and PostgreSQL connections are cut by a TCP proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from loomflow._cleanup import cleanup_errors
from loomflow.errors import (
    OwnershipLostError,
    SessionBusyError,
    StoreLockedError,
    StoreUnavailableError,
)
from loomflow.runtime import JournalRuntime, PostgresRuntime, SqliteRuntime

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).parent
SESSION, USER = "lease-session", "lease-user"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    if request.param == "sqlite":
        return "sqlite", str(tmp_path / "journal.db")
    return "postgres", request.getfixturevalue("pg_dsn")


def _runtime(backend: tuple[str, str], **options: Any) -> JournalRuntime:
    kind, target = backend
    if kind == "sqlite":
        return SqliteRuntime(target, **options)
    return PostgresRuntime(target, **options)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


class _Lines:
    """Reads JSON events from a child's stdout, each wait bounded."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []

    async def expect(self, event: str, timeout: float = 30.0) -> dict[str, Any]:  # noqa: ASYNC109
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = await self.proc.stdout.readline()
                assert line, f"stdout closed before {event!r}; events: {self.events}"
                message: dict[str, Any] = json.loads(line)
                self.events.append(message)
                if message["event"] == event:
                    return message
                assert message["event"] != "failed", message


async def _spawn(script: str, *args: str, stderr: Path) -> _Lines:
    with stderr.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HERE / script),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
    return _Lines(proc)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


async def _finish(worker: _Lines, *pids: int) -> None:
    """SIGKILL the worker and any process it forked, then wait until its pipes are closed.

    A forked child keeps the pipes open after the worker itself exits; leaving them to the
    garbage collector would fail a later test with a ResourceWarning.
    """
    for pid in (worker.proc.pid, *pids):
        _kill(pid)
    assert worker.proc.stdin is not None
    assert worker.proc.stdout is not None
    worker.proc.stdin.close()
    async with asyncio.timeout(10):
        await worker.proc.stdout.read()  # EOF once every holder of the pipe is gone
        await worker.proc.wait()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        await worker.proc.stdin.wait_closed()


def _bodies(log: Path) -> list[tuple[int, int]]:
    if not log.exists():
        return []
    return [(m["pid"], m["step"]) for m in map(json.loads, log.read_text().splitlines())]


# -- item: a runtime and a budget built before fork() ------------------------------------------


@pytest.mark.parametrize("connected", [True, False], ids=["connected", "unconnected"])
async def test_a_forked_child_holds_its_turn_under_its_own_pid(
    backend: tuple[str, str], tmp_path: Path, connected: bool
) -> None:
    """Parent builds (and connects), forks, exits; the live child's turn must not be taken."""
    log = tmp_path / "bodies.log"
    worker = await _spawn(
        "_fork_worker.py",
        *("--backend", backend[0], "--target", backend[1], "--log", str(log)),
        *("--session", SESSION, "--user", USER, "--parent", "exit"),
        *(() if connected else ("--cold",)),
        stderr=tmp_path / "fork.stderr",
    )
    forked = await worker.expect("forked")
    child_pid = forked["child"]
    try:
        reserved = await worker.expect("reserved")
        await worker.expect("holding")
        async with asyncio.timeout(10):
            await worker.proc.wait()  # the parent is gone; its pid no longer exists
        runtime = _runtime(backend, turn_timeout=1.5, lease_seconds=30)
        try:
            with pytest.raises(SessionBusyError):
                async with runtime.session(SESSION, USER):
                    raise AssertionError("took the turn of a live child")
            assert _bodies(log) == [(child_pid, 1)]
            assert reserved["pid"] == child_pid
            # The budget's hold names the child too, not the parent that built the budget.
            assert reserved["owner"].split(":")[1] == str(child_pid)

            assert worker.proc.stdin is not None
            worker.proc.stdin.write(b"go\n")
            await worker.proc.stdin.drain()
            await worker.expect("done")

            def never(i: int) -> int:
                raise AssertionError(f"step-{i} ran again")

            async with runtime.session(SESSION, USER, resume=True):
                assert await runtime.step("step-1", never, 1) == 1
                assert await runtime.step("step-2", never, 2) == 2
        finally:
            await runtime.close()
    finally:
        await _finish(worker, child_pid)
    assert _bodies(log) == [(child_pid, 1), (child_pid, 2)]


@pytest.mark.parametrize("connected", [True, False], ids=["connected", "unconnected"])
async def test_a_killed_forked_child_is_taken_over_at_once(
    backend: tuple[str, str], tmp_path: Path, connected: bool
) -> None:
    """The parent lives on; its SIGKILLed child's turn is free without waiting out the lease."""
    log = tmp_path / "bodies.log"
    worker = await _spawn(
        "_fork_worker.py",
        *("--backend", backend[0], "--target", backend[1], "--log", str(log)),
        *("--session", SESSION, "--user", USER, "--parent", "wait"),
        *(() if connected else ("--cold",)),
        stderr=tmp_path / "fork.stderr",
    )
    child_pid = (await worker.expect("forked"))["child"]
    try:
        await worker.expect("holding")
        os.kill(child_pid, signal.SIGKILL)
        await worker.expect("reaped")  # the child's pid is really gone; the parent is alive
        assert worker.proc.returncode is None

        runtime = _runtime(backend, turn_timeout=10, lease_seconds=30)
        try:

            def never(i: int) -> int:
                raise AssertionError(f"step-{i} ran again")

            started = time.monotonic()
            async with runtime.session(SESSION, USER) as run:
                took = time.monotonic() - started
                assert await runtime.step("step-1", never, 1) == 1
            assert run.epoch == 0  # continued the child's open run
        finally:
            await runtime.close()
        # The child's lease had 30 s to run; its dead pid frees the turn at once.
        assert took < 3.0, f"waited {took:.1f}s for a dead child's lease"
    finally:
        await _finish(worker, child_pid)
    assert _bodies(log) == [(child_pid, 1)]


# -- item: a zombie must not start another step body -------------------------------------------


def _take_over_in_thread(backend: tuple[str, str], after_s: float, name: str) -> list[str]:
    """From another thread (own runtime, own event loop): wait, take the turn, run ``name``."""
    ran: list[str] = []

    async def other() -> None:
        runtime = _runtime(backend, turn_timeout=10)
        try:
            async with runtime.session(SESSION, USER):
                await runtime.step(name, lambda: ran.append("B") or "B")
        finally:
            await runtime.close()

    def main() -> None:
        time.sleep(after_s)
        asyncio.run(other())

    thread = threading.Thread(target=main)
    thread.start()
    thread.join(30)  # blocks the caller's event loop too: its heartbeat cannot renew
    assert not thread.is_alive()
    return ran


@pytest.mark.parametrize("kind", ["step", "stream", "idempotent"])
async def test_a_run_stalled_past_its_lease_starts_no_body(
    backend: tuple[str, str], kind: str
) -> None:
    lease = 0.5
    runtime = _runtime(backend, lease_seconds=lease, turn_timeout=10)
    called: list[str] = []

    def body() -> str:
        called.append("A")
        return "A"

    async def stream() -> AsyncIterator[str]:
        called.append("A")
        yield "A"

    try:
        with pytest.raises(OwnershipLostError, match="was not started"):
            async with runtime.session(SESSION, USER):
                await runtime.step("step-1", body)
                # The whole process stalls (this thread blocks the loop) past the lease, and
                # another worker takes the turn meanwhile and runs step-2.
                assert _take_over_in_thread(backend, lease * 1.5, "step-2") == ["B"]
                if kind == "step":
                    await runtime.step("step-2", body)
                elif kind == "idempotent":
                    await runtime.step("step-2", body, idempotency_key="pay-42")
                else:
                    async for _ in runtime.stream_step("step-2", stream):
                        pass
        assert called == ["A"]  # step-1 only: no second body of step-2
    finally:
        await runtime.close()


async def test_a_run_stalled_between_its_claim_and_its_opening_names_its_session(
    backend: tuple[str, str],
) -> None:
    # A resume of a new session claims the turn, then opens the run in a second write. A
    # process stopped in between past its lease (SIGSTOP, a long GC pause) was told
    # 'lost ["lease-session","lease-user"] while opening the run': the store's internal key.
    lease = 0.5
    runtime = _runtime(backend, lease_seconds=lease, turn_timeout=10)
    store: Any = runtime._store
    begin_run = store.begin_run

    async def stalled(*args: Any) -> Any:
        assert _take_over_in_thread(backend, lease * 1.5, "step-1") == ["B"]
        return await begin_run(*args)

    store.begin_run = stalled
    try:
        with pytest.raises(OwnershipLostError) as caught:
            async with runtime.session(SESSION, USER, resume=True):
                pytest.fail("the run opened although another worker took the turn")
    finally:
        del store.begin_run
        await runtime.close()
    assert str(caught.value) == (
        f"session {SESSION!r} of user {USER!r} was taken over before the run could be opened"
    )


async def test_a_lost_turn_the_heartbeat_saw_first_reads_the_same(
    backend: tuple[str, str],
) -> None:
    """Whichever check learns first that the turn is gone, the step says it was not started."""
    lease = 0.5
    runtime = _runtime(backend, lease_seconds=lease, turn_timeout=10)
    called: list[str] = []
    try:
        with pytest.raises(OwnershipLostError, match="'step-2' was not started") as caught:
            async with runtime.session(SESSION, USER) as run:
                await runtime.step("step-1", lambda: called.append("A") or "A")
                assert _take_over_in_thread(backend, lease * 1.5, "step-2") == ["B"]
                for _ in range(500):  # let the heartbeat wake and be refused (10 s at most)
                    if run.lost:
                        break
                    await asyncio.sleep(0.02)
                assert run.lost
                await runtime.step("step-2", lambda: called.append("A") or "A")
        assert "now belongs to a newer run" in str(caught.value)
        assert called == ["A"]
    finally:
        await runtime.close()


async def test_a_run_stalled_past_its_lease_that_nobody_took_over_goes_on(
    backend: tuple[str, str],
) -> None:
    """A lapsed lease alone fences nothing: only a takeover does (docs/concepts)."""
    lease = 0.5
    runtime = _runtime(backend, lease_seconds=lease, turn_timeout=10)
    try:
        async with runtime.session(SESSION, USER):
            assert await runtime.step("step-1", lambda: "A") == "A"
            time.sleep(lease * 2)  # noqa: ASYNC251 - the whole process stalls; nobody takes over
            assert await runtime.step("step-2", lambda: "B") == "B"
        [info] = await runtime.sessions()
        assert (info.state, info.entries) == ("finished", 2)
    finally:
        await runtime.close()


async def test_a_run_cancelled_elsewhere_is_logged_as_cancelled_not_taken_over(
    backend: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    # The heartbeat of a run cancelled from another process (`loomflow runs cancel`) logged
    # "lost its turn to a newer owner" at error level: there is no newer owner.
    from loomflow.errors import RunCancelledError

    lease = 0.3
    runtime = _runtime(backend, lease_seconds=lease)
    other = _runtime(backend)
    try:
        with pytest.raises(RunCancelledError), caplog.at_level(logging.WARNING):
            async with runtime.session(SESSION, USER) as run:
                await runtime.step("step-1", lambda: "A")
                assert await other.cancel(SESSION, USER)
                # The heartbeat's next renewal is refused; up to 10 s on a loaded runner.
                for _ in range(500):
                    if run.lost:
                        break
                    await asyncio.sleep(0.02)
                await runtime.step("step-2", lambda: "B")
        said = [r.getMessage() for r in caplog.records if r.name.startswith("loomflow")]
        assert any("was cancelled; it stops at its next step" in m for m in said), said
        assert not any("newer owner" in m for m in said), said
    finally:
        await runtime.close()
        await other.close()


async def test_a_step_taken_while_the_heartbeat_asks_why_it_was_fenced_out_waits_for_the_answer(
    backend: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    # The heartbeat marks the run lost, then asks the store whether a cancel was the reason.
    # A step that came in meanwhile (a loaded machine, a slow store) raised OwnershipLostError
    # ("now belongs to a newer run") for a run that had only been cancelled.
    from loomflow.errors import RunCancelledError

    runtime = _runtime(backend, lease_seconds=0.3)
    other = _runtime(backend)
    store: Any = runtime._store
    status = store.run_status
    asking = asyncio.Event()

    async def slow_status(*args: Any) -> Any:
        asking.set()
        await asyncio.sleep(0.5)
        return await status(*args)

    try:
        with pytest.raises(RunCancelledError):
            async with runtime.session(SESSION, USER) as run:
                await runtime.step("step-1", lambda: "A")
                store.run_status = slow_status
                assert await other.cancel(SESSION, USER)
                await asyncio.wait_for(asking.wait(), 10)  # the heartbeat is asking now
                assert run.lost
                await runtime.step("step-2", lambda: "B")
    finally:
        del store.run_status
        await runtime.close()
        await other.close()


async def test_a_run_that_keeps_its_lease_pays_no_extra_round_trip(
    backend: tuple[str, str],
) -> None:
    """The check before a body reads a local clock while the lease is fresh."""
    runtime = _runtime(backend, lease_seconds=30)
    renewals = 0
    try:
        async with runtime.session(SESSION, USER):
            store = runtime._store
            renew = store.renew

            async def counting(*args: Any) -> bool:
                nonlocal renewals
                renewals += 1
                return await renew(*args)

            store.renew = counting  # type: ignore[method-assign]
            for i in range(20):
                await runtime.step(f"s{i}", lambda: 1)
    finally:
        await runtime.close()
    assert renewals == 0


# -- item: a paused SQLite writer --------------------------------------------------------------


async def test_a_stopped_sqlite_writer_is_named_not_blamed_on_a_migration(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    lease = 0.5
    writer = await _spawn(
        "_locked_writer.py", str(path), SESSION, USER, str(lease), stderr=tmp_path / "w.stderr"
    )
    pid = writer.proc.pid
    try:
        await writer.expect("locked")
        async with asyncio.timeout(5):
            while _state(pid) != "T":  # noqa: ASYNC110 - no event to wait on for a stop
                await asyncio.sleep(0.005)
        await asyncio.sleep(lease * 1.5)  # its lease is over too

        runtime = SqliteRuntime(path, busy_timeout_ms=300, turn_timeout=5)
        try:
            started = time.monotonic()
            await runtime.open()  # the schema is current: no write lock is needed to open
            opened = time.monotonic() - started
            with pytest.raises(StoreLockedError) as raised:
                async with runtime.session(SESSION, USER):
                    raise AssertionError("wrote past another process's write lock")
            error = raised.value
            assert isinstance(error, StoreUnavailableError)
            assert error.pid == pid
            assert error.stopped
            assert f"pid {pid} holds its write lock and is stopped" in str(error)
            assert "migration" not in str(error)
            assert opened < 0.25

            # Once the stopped writer is gone, its turn is taken over at once.
            os.kill(pid, signal.SIGKILL)
            await writer.proc.wait()
            async with runtime.session(SESSION, USER) as run:
                assert await runtime.step("step-1", lambda: "again") == "written"
            assert run.epoch == 0
        finally:
            await runtime.close()
    finally:
        await _finish(writer)


# -- a TCP proxy that can cut PostgreSQL away and bring it back --------------------------------


class _Proxy:
    """127.0.0.1:<port> -> the DSN's server; ``cut`` drops every connection and refuses new
    ones until ``restore`` listens again on the same port."""

    def __init__(self, dsn: str) -> None:
        self._parts = urlsplit(dsn)
        self._target = (self._parts.hostname or "127.0.0.1", self._parts.port or 5432)
        self._server: asyncio.Server | None = None
        self._port = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self._port)
        self._port = self._server.sockets[0].getsockname()[1]
        user, _, _ = self._parts.netloc.rpartition("@")
        host = f"127.0.0.1:{self._port}"
        return urlunsplit(self._parts._replace(netloc=f"{user}@{host}" if user else host))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers += [writer, up_writer]
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        with contextlib.suppress(OSError):
            dst.close()

    async def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def restore(self) -> None:
        await self.start()


# -- item: a process recognises its own lease ----------------------------------------------------


@pytest.mark.postgres
async def test_a_lease_left_by_a_failed_release_is_taken_back_at_once_postgres(
    pg_dsn: str,
) -> None:
    proxy = _Proxy(pg_dsn)
    runtime = await PostgresRuntime.connect(await proxy.start(), lease_seconds=30, turn_timeout=10)
    try:
        with pytest.raises(StoreUnavailableError):
            async with runtime.session(SESSION, USER):
                await runtime.step("step-1", lambda: "written")
                await proxy.cut()  # the server goes away before the turn is given back
        await proxy.restore()

        started = time.monotonic()
        async with runtime.session(SESSION, USER, resume=True) as run:
            took = time.monotonic() - started
            assert await runtime.step("step-1", lambda: "again") == "written"
        assert run.epoch == 0
        assert took < 2.0, f"waited {took:.1f}s for this process's own lease"
    finally:
        await runtime.close()
        await proxy.cut()


async def test_a_lease_left_by_a_failed_release_is_taken_back_at_once_sqlite(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path, lease_seconds=30, turn_timeout=10, busy_timeout_ms=200)
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        with pytest.raises(StoreLockedError, match="another connection of this process"):
            async with runtime.session(SESSION, USER):
                await runtime.step("step-1", lambda: "written")
                blocker.execute("BEGIN IMMEDIATE")  # the release cannot get the write lock
        blocker.execute("ROLLBACK")

        started = time.monotonic()
        async with runtime.session(SESSION, USER, resume=True) as run:
            took = time.monotonic() - started
            assert await runtime.step("step-1", lambda: "again") == "written"
        assert run.epoch == 0
        assert took < 2.0, f"waited {took:.1f}s for this process's own lease"
    finally:
        blocker.close()
        await runtime.close()


async def test_a_locked_journal_behind_a_symlink_names_who_holds_the_lock(
    tmp_path: Path,
) -> None:
    """SQLite keeps the -shm beside a symlink's target, where the lock is looked for too: the
    error said only "another process holds its write lock", whoever held it."""
    (tmp_path / "volume").mkdir()
    real = tmp_path / "volume" / "journal.db"
    link = tmp_path / "journal.db"
    link.symlink_to(real)
    runtime = SqliteRuntime(link, busy_timeout_ms=200)
    await runtime.open()
    blocker = sqlite3.connect(real, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreLockedError, match="another connection of this process"):
            async with runtime.session(SESSION, USER):
                raise AssertionError("wrote past another connection's write lock")
        blocker.execute("ROLLBACK")
    finally:
        blocker.close()
        await runtime.close()


async def test_another_runtime_of_this_process_still_waits_for_a_live_run(
    tmp_path: Path,
) -> None:
    """Only a lease no run here holds is taken back: a live one is waited for, as before."""
    path = tmp_path / "journal.db"
    first = SqliteRuntime(path, lease_seconds=30)
    second = SqliteRuntime(path, lease_seconds=30, turn_timeout=0.5)
    holding, done = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with first.session(SESSION, USER):
            holding.set()
            await done.wait()

    # The live run is in another task with a context of its own: inside its block a second
    # runtime on this journal would join it as a sub-run instead (see test_subrun_runtimes).
    holder = asyncio.create_task(hold(), context=contextvars.Context())
    try:
        await holding.wait()
        with pytest.raises(SessionBusyError):
            async with second.session(SESSION, USER):
                raise AssertionError("took a live run's turn")
    finally:
        done.set()
        await holder
        await first.close()
        await second.close()


# -- item: the first error wins over a failed cleanup ------------------------------------------


class _Boom(Exception):
    pass


@pytest.mark.postgres
async def test_a_failed_release_does_not_hide_the_runs_own_error(pg_dsn: str) -> None:
    proxy = _Proxy(pg_dsn)
    runtime = await PostgresRuntime.connect(await proxy.start(), lease_seconds=30)
    try:
        with pytest.raises(_Boom) as raised:
            async with runtime.session(SESSION, USER):
                await runtime.step("step-1", lambda: 1)
                await proxy.cut()
                raise _Boom("the run's own failure")
        attached = cleanup_errors(raised.value)
        assert len(attached) == 1
        assert isinstance(attached[0], StoreUnavailableError)
        assert any("giving back the session's turn failed" in n for n in raised.value.__notes__)
    finally:
        await runtime.close()
        await proxy.cut()


@pytest.mark.postgres
async def test_an_agent_run_raises_the_budget_error_not_the_failed_release(pg_dsn: str) -> None:
    """The budget store and the journal share a server that goes away mid-run: the caller
    learns that the budget refused the call, with the failed release attached."""
    from loomflow.agent import Agent
    from loomflow.agent.hooks import RunHooks, RunInfo
    from loomflow.errors import BudgetUnavailableError
    from loomflow.governance.budget import Cap, SqlBudgetStore, StandardBudget
    from loomflow.messages import Message, ModelResponse, ToolCall, ToolSpec
    from loomflow.models import FunctionModel
    from loomflow.tools import ToolOutcome, tool

    @tool
    def lookup(key: str) -> str:
        """Look a key up."""
        return f"value of {key}"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        if not any(m.role == "tool" for m in messages):
            call = ToolCall(id="c0", name="lookup", arguments={"key": "k"})
            return ModelResponse(tool_calls=[call], finish_reason="tool_calls")
        return ModelResponse(text="done")

    proxy = _Proxy(pg_dsn)

    class CutAfterTool(RunHooks):
        async def after_tool_call(
            self,
            info: RunInfo,
            turn: int,
            slot: int,
            call: ToolCall,
            outcome: ToolOutcome,
            *,
            replayed: bool,
        ) -> None:
            await proxy.cut()  # journaled the tool result; the next reservation fails

    runtime = await PostgresRuntime.connect(await proxy.start(), lease_seconds=30)
    budget = StandardBudget(
        [Cap("tokens_total", 10**6)], store=SqlBudgetStore(runtime.database), store_timeout_s=5
    )
    agent = Agent(
        "You look things up.",
        model=FunctionModel(decide),
        tools=[lookup],
        runtime=runtime,
        budget=budget,
        hooks=[CutAfterTool()],
    )
    try:
        with pytest.raises(BudgetUnavailableError) as raised:
            await agent.run("look it up", session_id=SESSION, user_id=USER)
        attached = cleanup_errors(raised.value)
        assert [type(e) for e in attached] == [StoreUnavailableError]
        assert "giving back the session's turn" in "\n".join(raised.value.__notes__)
    finally:
        await runtime.close()
        await proxy.cut()
