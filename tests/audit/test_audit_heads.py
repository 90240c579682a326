"""``AuditStore.heads()``: every user's recorded head, alike on every backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomflow.audit import (
    AuditRecord,
    AuditStore,
    ChainHead,
    InMemoryAuditStore,
    JsonlAuditStore,
    SqliteAuditStore,
)


def _store(kind: str, tmp_path: Path) -> AuditStore:
    if kind == "memory":
        return InMemoryAuditStore()
    if kind == "jsonl":
        return JsonlAuditStore(tmp_path / "audit.jsonl")
    return SqliteAuditStore(tmp_path / "audit.db")


@pytest.mark.parametrize("kind", ["memory", "jsonl", "sqlite"])
async def test_heads_name_every_user_with_their_last_entry(kind: str, tmp_path: Path) -> None:
    store = _store(kind, tmp_path)
    try:
        assert await store.heads() == []
        users = ["b/..", None, "a", "<é>"]
        written = await store.append(
            [AuditRecord(user_id=u, actor="t", action="x") for u in users for _ in range(2)]
        )
        heads = await store.heads()
        last = {e.user_id: e for e in written}
        assert sorted(heads, key=lambda h: str(h.user_id)) == sorted(
            (ChainHead(u, 2, last[u].hash) for u in users), key=lambda h: str(h.user_id)
        )
        assert heads == await store.heads()
    finally:
        await store.close()
