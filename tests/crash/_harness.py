"""Parent-side helpers for tests that run ``_worker.py`` in real child processes.

Every wait on a child is bounded: a hung or crashed worker fails the test with its stderr
attached instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomflow.runtime import JournalRuntime, PostgresRuntime, SqliteRuntime

WORKER = Path(__file__).with_name("_worker.py")


@dataclass(frozen=True)
class Journal:
    """Where the workers and the parent meet: a SQLite file or a PostgreSQL database."""

    backend: str  # "sqlite" or "postgres"
    target: str  # file path or DSN

    def worker_args(self) -> list[str]:
        return ["--backend", self.backend, "--target", self.target]

    async def open(self) -> JournalRuntime:
        if self.backend == "sqlite":
            runtime: JournalRuntime = SqliteRuntime(self.target)
            await runtime.migrate()
            return runtime
        return await PostgresRuntime.connect(self.target)


class Child:
    """One worker process, read line by line as JSON events."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, stderr: Path) -> None:
        self.name = name
        self.proc = proc
        self.stderr = stderr
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def spawn(cls, name: str, args: list[str], *, workdir: Path) -> Child:
        stderr = workdir / f"{name}.stderr"
        with stderr.open("wb") as err:  # the child keeps its own descriptor
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(WORKER),
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )
        return cls(name, proc, stderr)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def diagnose(self, what: str) -> AssertionError:
        tail = self.stderr.read_text(errors="replace")[-4000:]
        return AssertionError(
            f"worker {self.name} (pid {self.pid}) {what}; events so far: {self.events}\n"
            f"--- stderr ---\n{tail}"
        )

    # A timeout parameter rather than the caller's asyncio.timeout(): on expiry the failure
    # must carry the child's stderr, which only this object knows.
    async def expect(self, event: str, timeout: float = 30.0) -> dict[str, Any]:  # noqa: ASYNC109
        """Read events until ``event`` arrives; fail if the child exits or times out first."""
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    line = await self.proc.stdout.readline()
                    if not line:
                        raise self.diagnose(f"exited before reporting {event!r}")
                    message: dict[str, Any] = json.loads(line)
                    self.events.append(message)
                    if message["event"] == event:
                        return message
        except TimeoutError:
            raise self.diagnose(f"did not report {event!r} within {timeout:g}s") from None

    async def send(self, text: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{text}\n".encode())
        await self.proc.stdin.drain()

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    async def exit_code(self, timeout: float = 30.0) -> int:  # noqa: ASYNC109 - as expect()
        """Collect the remaining events and wait for the child to exit by itself."""
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                async for line in self.proc.stdout:
                    self.events.append(json.loads(line))
                return await self.proc.wait()
        except TimeoutError:
            raise self.diagnose(f"did not exit within {timeout:g}s") from None

    def last(self, event: str) -> dict[str, Any]:
        found = [e for e in self.events if e["event"] == event]
        if not found:
            raise self.diagnose(f"never reported {event!r}")
        return found[-1]

    async def kill(self) -> None:
        """SIGKILL (works on a stopped process too) and reap, so the pid is really gone."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        async with asyncio.timeout(10):
            await self.proc.wait()


async def kill_all(children: list[Child]) -> None:
    for child in children:
        await child.kill()


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def bodies_by_step(log: list[dict[str, Any]]) -> Counter[int]:
    """How many times each step's body started, over all processes."""
    return Counter(m["step"] for m in log if m["what"] == "begin")


def process_state(pid: int) -> str:
    # /proc/<pid>/stat is "pid (comm) S ...": the state letter follows the last ')'.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0]


def sqlite_writable(path: str) -> bool:
    """Whether nobody holds the SQLite write lock right now."""
    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


async def freeze(child: Child, journal: Journal) -> None:
    """SIGSTOP ``child`` at a moment when it holds no database lock.

    The worker may be stopped in the middle of a lease renewal. On PostgreSQL that is harmless
    (each statement commits on the server by itself), but a SQLite process frozen inside a
    write transaction would hold the file's write lock forever and block every other writer:
    a property of SQLite, not of the journal. So on SQLite we retry until the lock is free.
    """
    sqlite_file = journal.target if journal.backend == "sqlite" else None
    await freeze_pid(child.pid, sqlite_file, name=child.name)


async def freeze_pid(pid: int, sqlite_file: str | None, *, name: str = "") -> None:
    """:func:`freeze` for any child process ``pid`` using the SQLite file ``sqlite_file``
    (``None``: a PostgreSQL journal)."""
    for _ in range(100):
        os.kill(pid, signal.SIGSTOP)
        async with asyncio.timeout(5):
            # kill() returns before the stop lands; the kernel offers no event to wait on.
            while process_state(pid) != "T":  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        if sqlite_file is None or sqlite_writable(sqlite_file):
            return
        os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(0.005)
    raise AssertionError(f"worker {name or pid} kept holding the SQLite write lock")
