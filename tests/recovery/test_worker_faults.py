"""``loomflow worker`` when things go wrong around it, as real processes on real journals.

A database that stops answering (a proxy in front of PostgreSQL that stops forwarding), a
database that refuses, a health probe that gives up, SIGTERM during ``--once``, and a worker
id that is no id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from _fleet import HangingProxy, app_env, cli, start_and_kill, tool_counts, wait_for

from loomflow.errors import InvalidIdError
from loomflow.recovery import Recovery
from loomflow.runtime import InMemoryRuntime


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def journal_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'journal.db'}"
    return str(request.getfixturevalue("pg_dsn"))


async def _worker(env: dict[str, str], *options: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loomflow.cli",
        "worker",
        "_app:agents",
        *options,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def _port(proc: asyncio.subprocess.Process) -> int:
    """The port of a worker started with ``--json --port 0`` (its ``serving`` event)."""
    assert proc.stdout is not None
    serving = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
    assert serving["event"] == "serving"
    return int(serving["port"])


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def _until(port: int, status: int, timeout: float = 30, path: str = "/readyz") -> str:  # noqa: ASYNC109
    """Poll ``path`` until it answers ``status``; its body."""
    async with asyncio.timeout(timeout):
        while True:
            code, body = await asyncio.to_thread(_get, port, path)
            if code == status:
                return body
            await asyncio.sleep(0.1)


def _journal_failures(metrics: str) -> float:
    """``loomflow_store_unavailable_total{store="journal"}`` in a /metrics text."""
    prefix = 'loomflow_store_unavailable_total{store="journal"} '
    [line] = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(line.removeprefix(prefix))


async def _stop(proc: asyncio.subprocess.Process, timeout: float = 30) -> tuple[str, str, float]:  # noqa: ASYNC109
    """SIGTERM, then the process's output and how long it took to exit."""
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return out.decode(), err.decode(), time.monotonic() - started


@contextlib.asynccontextmanager
async def _ready_worker(
    env: dict[str, str], *options: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """A worker (``--json --port 0`` and ``options``) whose ``/readyz`` answered 200, and
    its port; killed at the end if still running."""
    proc = await _worker(env, "--port", "0", "--json", *options)
    try:
        port = await _port(proc)
        await _until(port, 200)
        yield proc, port
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# -- a database that stops answering ------------------------------------------------------


@contextlib.asynccontextmanager
async def _frozen_while_resuming(
    pg_dsn: str, proxy: HangingProxy, ledger: Path, prefix: str, *options: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """A worker (``--json --port 0`` and ``options``) that reaches the journal through the
    proxy, is ready and has resumed an orphaned run (blocked in ship); then the proxy
    freezes. The worker and its port; killed at the end if still running."""
    await start_and_kill(pg_dsn, ledger, 1, prefix)
    env = app_env(proxy.url(pg_dsn), ledger, FLEET_BLOCK="1")
    proc = await _worker(env, "--port", "0", "--json", *options)
    try:
        port = await _port(proc)
        await _until(port, 200)
        await wait_for(ledger, "blocked", 2)
        proxy.freeze()
        yield proc, port
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.postgres
async def test_a_journal_that_stops_answering_fails_readyz_and_sigterm_still_hands_over(
    pg_dsn: str, proxy: HangingProxy, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.jsonl"
    options = ("--interval", "0.2", "--sweep-timeout", "1")
    async with _frozen_while_resuming(pg_dsn, proxy, ledger, "hang", *options) as (proc, port):
        # Before: 200 for as long as the database hung, and not a word in the log.
        body = await _until(port, 503)
        assert body.startswith("not ready: the last sweep failed: TimeoutError: ")
        assert "\n" not in body.rstrip("\n")
        assert (await asyncio.to_thread(_get, port, "/healthz"))[0] == 200  # alive, not ready
        # ...and on /metrics, where LoomflowStoreUnavailable looks (the gauge keeps its value).
        assert _journal_failures((await asyncio.to_thread(_get, port, "/metrics"))[1]) >= 1
        # The hand-over cannot write to the journal either: bounded, then named.
        out, err, took = await _stop(proc)
    assert proc.returncode == 0, err[-3000:]
    assert took < 15, took
    assert "loomflow: warning: sweep failed (trying again in 0.2s): TimeoutError: the sweep " in err
    assert "did not finish within 1s (--sweep-timeout)" in err
    assert "1 run(s) not handed over within 1s" in err
    assert "session 'hang-0' of user 'ana'" in err
    assert "Traceback" not in err
    stopped = json.loads(out.splitlines()[-1])
    assert stopped["event"] == "stopped"
    assert stopped["not_handed_over"] == [{"session_id": "hang-0", "user_id": "ana"}]


@pytest.mark.postgres
async def test_readyz_fails_as_soon_as_sigterm_stops_the_worker_while_it_hands_over(
    pg_dsn: str, proxy: HangingProxy, tmp_path: Path
) -> None:
    # One sweep resumes the run; the next is far away. The hand-over cannot reach the
    # frozen journal: it takes its 5 s.
    options = ("--interval", "60", "--sweep-timeout", "10")
    ledger = tmp_path / "ledger.jsonl"
    async with _frozen_while_resuming(pg_dsn, proxy, ledger, "drain", *options) as (proc, port):
        proc.send_signal(signal.SIGTERM)
        # Before: "ready" for the whole hand-over, from a worker that takes no more work.
        body = await _until(port, 503, timeout=4)
        assert body == "not ready: the worker is stopping (SIGTERM or SIGINT)\n"
        assert (await asyncio.to_thread(_get, port, "/healthz"))[0] == 200
        out, err, _ = await _stop(proc)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1])["event"] == "stopped"


@pytest.mark.postgres
async def test_sigterm_cuts_short_a_sweep_waiting_on_a_hung_journal(
    pg_dsn: str, proxy: HangingProxy, tmp_path: Path
) -> None:
    # A sweep timeout far beyond the test: only the signal can end the sweep in flight.
    env = app_env(proxy.url(pg_dsn), tmp_path / "ledger.jsonl")
    async with _ready_worker(env, "--interval", "0.2", "--sweep-timeout", "600") as (proc, _):
        proxy.freeze()
        await asyncio.sleep(1)  # the next sweep has started and waits
        out, err, took = await _stop(proc)
    assert proc.returncode == 0, err[-3000:]
    assert took < 15, took  # closing the journal gives up after 5 s
    assert json.loads(out.splitlines()[-1])["event"] == "stopped"
    assert "Traceback" not in err


@pytest.mark.postgres
async def test_worker_once_on_a_hung_journal_fails_after_the_sweep_timeout(
    pg_dsn: str, proxy: HangingProxy, tmp_path: Path
) -> None:
    proxy.freeze()  # connections are accepted, and never answered
    env = app_env(proxy.url(pg_dsn), tmp_path / "ledger.jsonl")
    started = time.monotonic()
    code, _out, err = await cli("worker", "_app:agents", "--once", "--sweep-timeout", "1", env=env)
    assert code == 1, err
    assert time.monotonic() - started < 20
    assert "loomflow: error: the sweep did not finish within 1s (--sweep-timeout)" in err
    assert "Traceback" not in err


# -- a sweep that fails says why ------------------------------------------------------------


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A PostgreSQL URL on a port that refuses connections (bound, never listening)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"postgresql://nobody@127.0.0.1:{held.getsockname()[1]}/nothing"


async def test_a_failed_sweep_says_why_in_the_log_and_in_readyz(
    refused_url: str, tmp_path: Path
) -> None:
    env = app_env(refused_url, tmp_path / "ledger.jsonl")
    proc = await _worker(env, "--port", "0", "--json", "--interval", "0.2")
    try:
        port = await _port(proc)
        async with asyncio.timeout(30):
            while True:
                body = (await asyncio.to_thread(_get, port, "/readyz"))[1]
                if "sweep failed" in body:
                    break
                await asyncio.sleep(0.1)
        metrics = (await asyncio.to_thread(_get, port, "/metrics"))[1]
        _out, err, _ = await _stop(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert _journal_failures(metrics) >= 1
    assert body.startswith("not ready: the last sweep failed: StoreUnavailableError: ")
    assert "has not answered yet" not in body
    warnings = [line for line in err.splitlines() if "sweep failed" in line]
    assert warnings
    assert warnings[0].startswith(
        "loomflow: warning: sweep failed (trying again in 0.2s): StoreUnavailableError: "
    )
    assert "Traceback" not in err


@pytest.mark.postgres
async def test_a_database_that_goes_away_is_logged_on_one_line_a_warning(
    pg_dsn: str, proxy: HangingProxy, tmp_path: Path
) -> None:
    # The pool had its connection, then the server went away (a restart, a failover): the
    # driver's pool tries to reconnect in the background and logs each failure.
    env = app_env(proxy.url(pg_dsn), tmp_path / "ledger.jsonl")
    async with _ready_worker(env, "--interval", "0.2") as (proc, port):
        proxy.cut()
        body = await _until(port, 503)
        await asyncio.sleep(3)  # the pool's reconnections: at once, then after 1 s, 2 s
        _out, err, _ = await _stop(proc)
    assert proc.returncode == 0, err[-3000:]
    assert body.startswith("not ready: the last sweep failed: StoreUnavailableError: ")
    # Before: asyncpg's "Failed to restore the pool connection floor; retrying" and a
    # traceback of some twenty lines, at every reconnection, between the worker's own lines.
    assert "Traceback" not in err, err[-3000:]
    lines = err.splitlines()
    assert lines, err
    assert all(line.startswith("loomflow: ") for line in lines), err[-3000:]
    pool = [line for line in lines if "pool connection floor" in line]
    assert pool, err[-3000:]
    assert pool[0].startswith("loomflow: warning: asyncpg: Failed to restore the pool ")


def test_the_cli_log_line_names_the_exception_on_one_line() -> None:
    from loomflow.cli.main import _CliLogHandler

    try:
        raise ValueError('relation "loom_sessions" does not exist\nDETAIL: \x1b[2J')
    except ValueError:
        record = logging.LogRecord(
            "loomflow.worker", logging.WARNING, __file__, 1, "sweep %s", ("failed",), sys.exc_info()
        )
    line = _CliLogHandler().format(record)
    assert line == (
        'loomflow: warning: sweep failed: ValueError: relation "loom_sessions" does not exist'
        "\\nDETAIL: \\x1b[2J"
    )
    plain = logging.LogRecord("loomflow", logging.WARNING, __file__, 1, "a\rb", (), None)
    assert _CliLogHandler().format(plain) == "loomflow: warning: a\\rb"


# -- a health probe that gives up -----------------------------------------------------------


async def test_probes_that_give_up_leave_no_traceback(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    proc = await _worker(app_env(url, tmp_path / "ledger.jsonl"), "--port", "0", "--json")
    try:
        port = await _port(proc)
        await _until(port, 200)

        def give_up(reset: bool) -> None:
            # A probe whose timeout ran out: it sent its request and went away (a reset, or
            # a plain close) before the worker, frozen meanwhile, answered.
            with socket.create_connection(("127.0.0.1", port), timeout=5) as probe:
                probe.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                if reset:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

        os.kill(proc.pid, signal.SIGSTOP)  # slow to answer: CPU-starved, a GC pause...
        try:
            for reset in (True, False, True, False):
                await asyncio.to_thread(give_up, reset)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        await asyncio.sleep(1)
        assert (await asyncio.to_thread(_get, port, "/healthz"))[0] == 200
        _out, err, _ = await _stop(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "Error" not in err


# -- SIGTERM during --once ------------------------------------------------------------------


async def test_sigterm_makes_worker_once_hand_its_runs_over_and_exit_0(
    journal_url: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.jsonl"
    await start_and_kill(journal_url, ledger, 2, "once")
    proc = await _worker(app_env(journal_url, ledger, FLEET_BLOCK="1"), "--once")
    try:
        await wait_for(ledger, "blocked", 4)  # the runs resumed, blocked in ship again
        out, err, _ = await _stop(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err[-3000:]  # was killed by the signal (-15)
    assert "stopped: the runs it held are handed over" in out
    # Handed over: the next worker takes them now, not after the 30 s lease.
    started = time.monotonic()
    code, out, err = await cli("worker", "_app:agents", "--once", env=app_env(journal_url, ledger))
    assert code == 0, err
    assert "resumed 2" in out
    assert time.monotonic() - started < 20
    assert tool_counts(ledger, "ship") == {"once-0": 1, "once-1": 1}


# -- a worker id that is no id --------------------------------------------------------------


@pytest.mark.parametrize(
    ("worker_id", "message"),
    [
        ("w1\x1b[2J\x1b[31m", "contains the control character U+001B"),
        ("w1\nloomflow: error: forged", "contains the control character U+000A"),
        ("w" * 257, "is 257 bytes long in UTF-8, over the 256-byte limit"),
        ("", "must not be empty"),
    ],
)
async def test_a_bad_worker_id_is_refused_before_anything_runs(
    worker_id: str, message: str, tmp_path: Path
) -> None:
    env = app_env(f"sqlite:///{tmp_path / 'journal.db'}", tmp_path / "ledger.jsonl")
    code, out, err = await cli("worker", "_app:agents", "--once", "--worker-id", worker_id, env=env)
    assert code == 2
    assert f"argument --worker-id: {message}" in err
    assert "\x1b" not in err + out
    assert "forged" not in err + out
    assert not (tmp_path / "journal.db").exists()


def test_recovery_refuses_a_worker_id_that_is_no_id() -> None:
    runtime = InMemoryRuntime()
    for bad in ("w\x1b[2J", "a\rb", "x" * 257, ""):
        with pytest.raises(InvalidIdError) as caught:
            Recovery(runtime, {}, worker_id=bad)
        assert caught.value.field == "worker_id"
    assert Recovery(runtime, {}, worker_id="w\u00e9-1").worker_id == "w\u00e9-1"


@pytest.mark.postgres
async def test_closing_a_journal_whose_server_stopped_answering_is_bounded(
    pg_dsn: str, proxy: HangingProxy
) -> None:
    """asyncpg's pool close waits for every connection in use: one whose statement waits on
    a hung server never comes back. The close gives up after its limit and drops them."""
    from loomflow.errors import StoreUnavailableError
    from loomflow.runtime import PostgresRuntime

    runtime = PostgresRuntime(proxy.url(pg_dsn))
    await runtime.sessions(limit=1)  # connected, schema checked
    proxy.freeze()
    stuck = asyncio.create_task(runtime.sessions(limit=1))
    await asyncio.sleep(0.5)  # the statement is out, and waits
    t0 = time.monotonic()
    await asyncio.wait_for(runtime.close(), 60)  # it used to wait as long as the server hung
    took = time.monotonic() - t0
    assert took < 20, took  # the lane's 5 s, then the pool's 10 s
    with pytest.raises((StoreUnavailableError, asyncio.CancelledError)):
        await asyncio.wait_for(stuck, 10)


async def test_a_worker_whose_event_loop_is_blocked_says_so_on_healthz_and_readyz(
    tmp_path: Path,
) -> None:
    # A blocking call in an async tool stops the worker's event loop: no sweep, no lease
    # renewal, no signal handled. /healthz kept answering 200 (its server runs in a thread)
    # and /readyz "ready" from the last sweep, so no liveness probe ever restarted it.
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    ledger = tmp_path / "ledger.jsonl"
    gate = tmp_path / "gate"
    await start_and_kill(url, ledger, 1, "wedge")
    env = app_env(url, ledger, FLEET_WEDGE="1", FLEET_GATE=str(gate))
    proc = await _worker(env, "--json", "--port", "0", "--interval", "0.2", "--sweep-timeout", "2")
    try:
        port = await _port(proc)
        await wait_for(ledger, "wedged", 1)
        assert "has not run for" in await _until(port, 503, path="/healthz")
        code, body = await asyncio.to_thread(_get, port, "/readyz")
        assert code == 503
        assert "has not run for" in body
        gate.touch()  # the tool returns: the loop runs again
        assert await _until(port, 200, path="/healthz") == "ok\n"
        await wait_for(ledger, "ship", 1)
        await _until(port, 200)
    finally:
        gate.touch()
        _out, err, _took = await _stop(proc)
    assert proc.returncode == 0, err[-3000:]
    assert tool_counts(ledger, "ship") == {"wedge-0": 1}
