"""Parent-side helpers: start the app's runs in a child, kill it, read the ledger, run the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
APP = HERE / "_app.py"


def app_env(url: str, ledger: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "LOOMFLOW_"))}
    env.update(FLEET_URL=url, FLEET_LEDGER=str(ledger), PYTHONPATH=str(HERE))
    env.update(extra)
    return env


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
    return proc.pid


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
