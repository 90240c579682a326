"""A program that never closes its SQLite runtime still exits, and what it journaled stays."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

from loomflow.runtime import SqliteRuntime


def test_an_unclosed_sqlite_runtime_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    script = textwrap.dedent(
        f"""
        import asyncio
        from loomflow.runtime import SqliteRuntime

        async def main():
            runtime = SqliteRuntime({str(path)!r})  # never closed
            async with runtime.session("s", user_id="u"):
                print(await runtime.step("answer", lambda: asyncio.sleep(0, result=42)))

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "42"

    async def journaled() -> list[str]:
        runtime = SqliteRuntime(path)
        try:
            return [e.name for e in await runtime.entries("s", "u")]
        finally:
            await runtime.close()

    assert asyncio.run(journaled()) == ["answer"]
