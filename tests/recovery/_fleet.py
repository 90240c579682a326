"""Parent-side helpers: start the app's runs in a child, kill it, read the ledger, run the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
APP = HERE / "_app.py"


def python_path() -> str:
    """The children's PYTHONPATH: this directory (the apps), then the test run's own (a
    checkout run with PYTHONPATH=. tests its own loomflow, not an installed one)."""
    return os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)


def app_env(url: str, ledger: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "LOOMFLOW_"))}
    env.update(FLEET_URL=url, FLEET_LEDGER=str(ledger), PYTHONPATH=python_path())
    env.update(extra)
    return env


class HangingProxy:
    """A TCP proxy in front of a database that can stop answering without going away.

    ``freeze()`` stops forwarding in both directions: connections stay open and new ones are
    accepted, but no byte passes, as with a database host that hangs or a network path that
    drops packets without resetting. ``thaw()`` forwards again. Threads, so the test's own
    event loop goes on; ``close()`` ends every connection.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        self._refusing = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, dsn: str) -> str:
        """``dsn`` (a postgresql:// URL on ``target``) pointed at this proxy instead."""
        host, port = self.target
        return dsn.replace(f"@{host}:{port}/", f"@127.0.0.1:{self.port}/", 1)

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        """Close every connection and refuse new ones (each is closed as soon as it is
        accepted), as when the database host goes away or restarts."""
        self._refusing = True
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in [self._listener, *sockets]:
            sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._refusing:
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()

    def _pipe(self, client: socket.socket, server: socket.socket) -> None:
        peer = {client: server, server: client}
        try:
            while not self._closed:
                self._flowing.wait()
                ready, _, _ = select.select([client, server], [], [], 0.05)
                for sock in ready:
                    if not self._flowing.is_set():
                        break  # frozen while waiting: leave the bytes where they are
                    data = sock.recv(65536)
                    if not data:
                        return
                    peer[sock].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            client.close()
            server.close()


def ledger_lines(ledger: Path) -> list[dict[str, Any]]:
    if not ledger.exists():
        return []
    return [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]


def tool_counts(ledger: Path, tool: str) -> Counter[str]:
    return Counter(line["session"] for line in ledger_lines(ledger) if line["tool"] == tool)


async def start_and_kill(url: str, ledger: Path, count: int, prefix: str, **extra_env: str) -> int:
    """Start ``count`` runs in a child that blocks them in ``ship``; SIGKILL it; its pid."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(APP),
        "start",
        str(count),
        prefix,
        env=app_env(url, ledger, FLEET_BLOCK="1", **extra_env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    await kill_when_blocked(proc, ledger, count)
    return proc.pid


async def kill_when_blocked(proc: Any, ledger: Path, count: int) -> None:
    """SIGKILL the child once ``count`` of its runs have written ``blocked`` to the ledger."""
    try:
        async with asyncio.timeout(60):
            while sum(tool_counts(ledger, "blocked").values()) < count:
                if proc.returncode is not None:
                    err = (await proc.stderr.read()).decode() if proc.stderr else ""
                    raise AssertionError(f"starter exited {proc.returncode}: {err[-3000:]}")
                await asyncio.sleep(0.05)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL


async def cli(*args: str, env: dict[str, str], timeout: float = 60) -> tuple[int, str, str]:  # noqa: ASYNC109
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loomflow.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(timeout):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def wait_for(ledger: Path, tool: str, count: int, timeout: float = 60) -> None:  # noqa: ASYNC109
    async with asyncio.timeout(timeout):
        while sum(tool_counts(ledger, tool).values()) < count:  # noqa: ASYNC110 - a file
            await asyncio.sleep(0.05)


async def start_blocked(url: str, ledger: Path, count: int, prefix: str, gate: Path) -> Any:
    """Start ``count`` runs in a live child, blocked in ``ship`` until ``gate`` exists."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(APP),
        "start",
        str(count),
        prefix,
        env=app_env(url, ledger, FLEET_BLOCK="1", FLEET_GATE=str(gate)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    await wait_for(ledger, "blocked", count)
    return proc


async def close_agents(agents: dict[str, Any]) -> None:
    """Close the runtimes and audit logs of the app's agents (built in the test's process)."""
    from loomflow.audit import AuditLog

    for agent in agents.values():
        assert agent.runtime is not None
        await agent.runtime.close()
        if isinstance(agent.audit, AuditLog):
            await agent.audit.close()
