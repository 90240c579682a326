"""Helpers of the console tests: a real deployment written by real agent runs, and the
console served by uvicorn on a free port in a thread of this process."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from loomflow.agent import Agent
from loomflow.audit import AuditRecord
from loomflow.config import Settings
from loomflow.console import ConsoleOptions, build_console
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.stores import Stores
from loomflow.tools import tool

ADMIN = "admin-token-0123456789abcdef"
READER = "reader-token-0123456789abcdef"
# A user id meant to break pages and paths: markup, a path climb, a slash, non-ASCII.
HOSTILE = '<script>alert("x")</script>/../évé 🚀'
BOB = "bob"
RESUMED = "ana.silva"  # a user whose run was killed and resumed
BOB_EXTRA = 60  # audit entries added to bob's trail, so that it takes several pages


@tool
def lookup(order_id: str) -> str:
    """Look an order up."""
    return f"{order_id} has shipped"


class Crash(BaseException):
    """Escapes the tool layer, as a dying worker would."""


crash_next: list[bool] = []


@tool
def ship(order_id: str) -> str:
    """Ship an order (the first time, the worker dies instead)."""
    if crash_next:
        crash_next.pop()
        raise Crash
    return f"{order_id} shipped"


async def _crash_and_resume(settings: Settings, user_id: str, session_id: str) -> str:
    """A run killed at its tool call, then resumed: the model call replays from the journal."""

    def model() -> ScriptedModel:
        return ScriptedModel(
            [[ToolCall(id="c1", name="ship", arguments={"order_id": "B-7"})], "B-7 shipped."]
        )

    crash_next.append(True)
    async with Agent.from_settings(
        "Support.", model=model(), tools=[ship], settings=settings
    ) as agent:
        try:
            await agent.run("Ship B-7", session_id=session_id, user_id=user_id)
        except Crash:
            pass
        else:
            raise AssertionError("the run should have died")
    async with Agent.from_settings(
        "Support.", model=model(), tools=[ship], settings=settings
    ) as agent:
        result = await agent.run("Ship B-7", session_id=session_id, user_id=user_id)
        assert result.output == "B-7 shipped."
        return str(result.run_id)


@dataclass
class Deployment:
    root: Path
    url: str
    settings: Settings
    tokens: Path
    runs: dict[str, str]  # user id -> run id of its agent run
    tables: list[str]  # the database's tables before any console opened it


async def run_agent(settings: Settings, user_id: str, session_id: str) -> str:
    model = ScriptedModel(
        [[ToolCall(id="c1", name="lookup", arguments={"order_id": "A-1"})], "A-1 has shipped."]
    )
    async with Agent.from_settings(
        "Support.", model=model, tools=[lookup], settings=settings
    ) as agent:
        result = await agent.run(
            "Where is A-1? Mail ana@example.com", session_id=session_id, user_id=user_id
        )
        assert result.output == "A-1 has shipped."
        return str(result.run_id)


async def build(root: Path) -> Deployment:
    url = f"sqlite:///{root / 'journal.db'}"
    settings = Settings(runtime_url=url)
    async with Stores(settings) as stores:
        await stores.migrate()
    runs = {}
    for user, session in ((HOSTILE, "s-hostile"), (BOB, "s-bob"), ("..", "s-dots")):
        runs[user] = await run_agent(settings, user, session)
    runs[RESUMED] = await _crash_and_resume(settings, RESUMED, "s-resumed")
    async with Stores(settings, journal=False) as stores:
        await stores.audit.append(
            [
                AuditRecord(
                    user_id=BOB,
                    session_id="s-bob",
                    run_id=runs[BOB],
                    actor="policy:refunds",
                    action="permission.decision",
                    payload={"tool": "refund", "decision": "deny", "reason": "over the limit"},
                ),
                AuditRecord(
                    user_id=BOB,
                    session_id="s-bob",
                    run_id=runs[BOB],
                    actor="budget",
                    action="budget.warning",
                    payload={"cap": "daily", "spent_usd": 0.8},
                ),
            ]
            + [
                AuditRecord(
                    user_id=BOB,
                    session_id="s-extra",
                    actor="app",
                    action="note.added",
                    # A writer that did not redact: the console redacts what it shows.
                    payload={"n": i, "note": "key s3cr3t-value-xyz for bob@example.com"},
                )
                for i in range(BOB_EXTRA)
            ]
        )
    tokens = root / "tokens"
    tokens.write_text(
        f"# role token name\nadmin {ADMIN} ada\nreader {READER} rob\n", encoding="utf-8"
    )
    return Deployment(root, url, settings, tokens, runs, tables(root / "journal.db"))


def tables(path: Path) -> list[str]:
    with sqlite3.connect(path) as db:
        return sorted(r[0] for r in db.execute("SELECT name FROM sqlite_master"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """The console served by uvicorn in a thread; its stores live on that thread's loop."""

    def __init__(self, settings: Settings, options: ConsoleOptions) -> None:
        self.app, self.stores = build_console(settings, options)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        try:
            await self.server.serve()
        finally:
            await self.stores.close()

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the console did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def client(self, token: str | None = None, **kw: Any) -> httpx.Client:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        return httpx.Client(base_url=self.base, headers=headers, timeout=30, **kw)
