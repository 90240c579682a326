"""Helpers of the tests that edit journal rows by hand: a side effect to count, an edit of a
SQLite file from outside the runtime, and one run that makes the side effect once."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from loomflow.runtime import JournalRuntime


class Charge:
    """A tool with a side effect: every call charges the card again."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, amount: int) -> dict[str, int]:
        self.calls += 1
        return {"charged": amount, "n": self.calls}


def sqlite_exec(path: Path, *statements: str) -> None:
    """Run ``statements`` on the SQLite file in one transaction, as another program would."""
    conn = sqlite3.connect(path)
    try:
        with conn:
            for sql in statements:
                conn.execute(sql)
    finally:
        conn.close()


async def charged_once(runtime: JournalRuntime, charge: Charge, *, finish: bool = True) -> None:
    """One run of session ('s', 'u') that charges 10, then finishes (or crashes)."""
    try:
        async with runtime.session("s", "u"):
            await runtime.step("charge", charge, 10)
            if not finish:
                raise RuntimeError("crash")
    except RuntimeError:
        pass
