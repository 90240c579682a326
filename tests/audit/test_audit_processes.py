"""Several real processes appending to one audit store: chains stay gap-free and linked."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from loomflow.audit import audit_store_from_url

pytestmark = pytest.mark.timeout(180)

WRITER = Path(__file__).with_name("_writer.py")
WORKERS, COUNT = 4, 30


@pytest.fixture(params=["jsonl", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "jsonl":
        return f"jsonl:///{tmp_path / 'audit.jsonl'}"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'audit.db'}"
    return str(request.getfixturevalue("pg_dsn"))


async def _migrate(url: str) -> None:
    store = audit_store_from_url(url)
    await store.open()
    await store.close()


async def _read(url: str) -> tuple[list[Any], Any]:
    store = audit_store_from_url(url)
    try:
        return [e async for e in store.entries(user_id="shared")], await store.verify()
    finally:
        await store.close()


# A plain test: the parent only waits on its children, so blocking calls are what it needs.
def test_writers_in_several_processes_keep_every_chain_gap_free(url: str, tmp_path: Path) -> None:
    asyncio.run(_migrate(url))  # once up front: the workers race on appends, not on DDL
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{w}" for w in range(WORKERS)]
    children = [
        subprocess.Popen(
            [sys.executable, str(WRITER), url, str(w), str(COUNT), str(ready[w]), str(go)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(WORKERS)
    ]
    try:
        deadline = time.monotonic() + 60
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline, "workers did not start"
            assert all(c.poll() is None for c in children), [c.stderr for c in children]
            time.sleep(0.01)
        go.touch()
        for child in children:
            _, err = child.communicate(timeout=120)
            assert child.returncode == 0, err
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()

    shared, report = asyncio.run(_read(url))
    assert [e.seq for e in shared] == list(range(1, WORKERS * COUNT + 1))
    assert {e.actor for e in shared} == {f"w{w}" for w in range(WORKERS)}
    # Writers really interleaved: the chain switches worker many times.
    switches = sum(1 for a, b in itertools.pairwise(shared) if a.actor != b.actor)
    assert switches >= WORKERS - 1
    assert report.ok, report.problems[:5]
    assert report.entries == WORKERS * COUNT + WORKERS * (COUNT // 2)
