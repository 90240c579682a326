"""The audit store conformance suite on memory, JSONL, SQLite and PostgreSQL.

Each backend brings a tamperer that edits the storage behind the store's back: list surgery
for memory, line surgery for JSONL, and SQL run with the append-only triggers out of the way
for the databases (dropped on SQLite, ``session_replication_role = replica`` on PostgreSQL,
which is what a superuser bent on rewriting history would do).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from loomflow.audit import (
    AuditEntry,
    AuditStore,
    InMemoryAuditStore,
    JsonlAuditStore,
    PostgresAuditStore,
    SqliteAuditStore,
)
from loomflow.audit._entry import canonical_json, user_key
from loomflow.testing.audit_conformance import AuditStoreConformance, StoreFactory

# -- memory ---------------------------------------------------------------------------------


class MemoryTamper:
    def __init__(self, store: InMemoryAuditStore) -> None:
        self.entries = store.all_entries

    def _at(self, user_id: str | None, seq: int) -> int:
        return next(i for i, e in enumerate(self.entries) if e.user_id == user_id and e.seq == seq)

    async def edit_payload(self, user_id: str | None, seq: int, payload: dict[str, Any]) -> None:
        i = self._at(user_id, seq)
        self.entries[i] = self.entries[i].model_copy(update={"payload": payload})

    async def replace(self, entry: AuditEntry) -> None:
        self.entries[self._at(entry.user_id, entry.seq)] = entry

    async def delete(self, user_id: str | None, seq: int) -> None:
        del self.entries[self._at(user_id, seq)]

    async def swap(self, user_id: str | None, seq_a: int, seq_b: int) -> None:
        a, b = self._at(user_id, seq_a), self._at(user_id, seq_b)
        self.entries[a], self.entries[b] = self.entries[b], self.entries[a]


class TestInMemory(AuditStoreConformance):
    @pytest.fixture
    def shared(self) -> InMemoryAuditStore:
        return InMemoryAuditStore()

    @pytest.fixture
    async def make_store(self, shared: InMemoryAuditStore) -> StoreFactory:
        async def factory() -> AuditStore:
            return shared  # one process: "another worker" shares the object

        return factory

    @pytest.fixture
    def tamper(self, shared: InMemoryAuditStore) -> MemoryTamper:
        return MemoryTamper(shared)


# -- JSONL ----------------------------------------------------------------------------------


class JsonlTamper:
    def __init__(self, path: Path) -> None:
        self.path = path

    def _lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text().splitlines()]

    def _save(self, rows: list[dict[str, Any]]) -> None:
        self.path.write_text("".join(canonical_json(r) + "\n" for r in rows))

    def _at(self, rows: list[dict[str, Any]], user_id: str | None, seq: int) -> int:
        return next(i for i, r in enumerate(rows) if r["user_id"] == user_id and r["seq"] == seq)

    async def edit_payload(self, user_id: str | None, seq: int, payload: dict[str, Any]) -> None:
        rows = self._lines()
        rows[self._at(rows, user_id, seq)]["payload"] = payload
        self._save(rows)

    async def replace(self, entry: AuditEntry) -> None:
        rows = self._lines()
        rows[self._at(rows, entry.user_id, entry.seq)] = entry.to_json()
        self._save(rows)

    async def delete(self, user_id: str | None, seq: int) -> None:
        rows = self._lines()
        del rows[self._at(rows, user_id, seq)]
        self._save(rows)

    async def swap(self, user_id: str | None, seq_a: int, seq_b: int) -> None:
        rows = self._lines()
        a, b = self._at(rows, user_id, seq_a), self._at(rows, user_id, seq_b)
        rows[a], rows[b] = rows[b], rows[a]
        self._save(rows)


class TestJsonl(AuditStoreConformance):
    @pytest.fixture
    async def make_store(self, tmp_path: Path) -> StoreFactory:
        async def factory() -> AuditStore:
            return JsonlAuditStore(tmp_path / "audit.jsonl")

        return factory

    @pytest.fixture
    def tamper(self, tmp_path: Path) -> JsonlTamper:
        return JsonlTamper(tmp_path / "audit.jsonl")


# -- SQL ------------------------------------------------------------------------------------

_CONTENT = (
    "user_key, user_id, seq, time_us, session_id, run_id, actor, action, payload, "
    "schema_version, prev_hash, hash, payload_digest, payload_salt"
)


def _row(entry: AuditEntry) -> tuple[Any, ...]:
    return (
        user_key(entry.user_id),
        entry.user_id,
        entry.seq,
        entry.time_us,
        entry.session_id,
        entry.run_id,
        entry.actor,
        entry.action,
        canonical_json(entry.payload),
        entry.schema_version,
        entry.prev_hash,
        entry.hash,
        entry.payload_digest,
        entry.payload_salt,
    )


class SqliteTamper:
    def __init__(self, path: Path) -> None:
        self.path = path

    def _run(self, sql: str, *args: Any) -> list[Any]:
        with sqlite3.connect(self.path) as conn:
            for name in ("loom_audit_no_update", "loom_audit_no_delete"):
                conn.execute(f"DROP TRIGGER IF EXISTS {name}")
            return conn.execute(sql, args).fetchall()

    async def edit_payload(self, user_id: str | None, seq: int, payload: dict[str, Any]) -> None:
        self._run(
            "UPDATE loom_audit SET payload = ? WHERE user_key = ? AND seq = ?",
            canonical_json(payload),
            user_key(user_id),
            seq,
        )

    async def replace(self, entry: AuditEntry) -> None:
        self._run(
            "UPDATE loom_audit SET payload = ?, payload_digest = ?, payload_salt = ?, hash = ? "
            "WHERE user_key = ? AND seq = ?",
            canonical_json(entry.payload),
            entry.payload_digest,
            entry.payload_salt,
            entry.hash,
            user_key(entry.user_id),
            entry.seq,
        )

    async def delete(self, user_id: str | None, seq: int) -> None:
        self._run("DELETE FROM loom_audit WHERE user_key = ? AND seq = ?", user_key(user_id), seq)

    async def swap(self, user_id: str | None, seq_a: int, seq_b: int) -> None:
        # Each entry's content moves into the other's row; row ids (the storage order) stay.
        key = user_key(user_id)
        assign = ", ".join(f"{c} = ?" for c in _CONTENT.split(", "))
        with sqlite3.connect(self.path) as conn:
            conn.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
            rows = {
                int(r[1]): (int(r[0]), r[2:])
                for r in conn.execute(
                    f"SELECT id, seq, {_CONTENT} FROM loom_audit WHERE user_key = ? "
                    "AND seq IN (?, ?)",
                    (key, seq_a, seq_b),
                )
            }
            conn.execute(
                "UPDATE loom_audit SET seq = -seq WHERE user_key = ? AND seq IN (?, ?)",
                (key, seq_a, seq_b),
            )
            for seq, other in ((seq_a, seq_b), (seq_b, seq_a)):
                conn.execute(
                    f"UPDATE loom_audit SET {assign} WHERE id = ?", (*rows[other][1], rows[seq][0])
                )


class TestSqlite(AuditStoreConformance):
    @pytest.fixture
    async def make_store(self, tmp_path: Path) -> AsyncIterator[StoreFactory]:
        opened: list[AuditStore] = []

        async def factory() -> AuditStore:
            store = SqliteAuditStore(tmp_path / "audit.db")
            opened.append(store)
            return store

        yield factory
        for store in opened:
            await store.close()

    @pytest.fixture
    def tamper(self, tmp_path: Path) -> SqliteTamper:
        return SqliteTamper(tmp_path / "audit.db")


class PostgresTamper:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    async def _run(self, sql: str, *args: Any) -> list[Any]:
        import asyncpg

        conn = await asyncpg.connect(self.dsn)
        try:
            # A superuser can switch triggers off for a session: the chain must still tell.
            await conn.execute("SET session_replication_role = replica")
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    async def edit_payload(self, user_id: str | None, seq: int, payload: dict[str, Any]) -> None:
        await self._run(
            "UPDATE loom_audit SET payload = $1 WHERE user_key = $2 AND seq = $3",
            canonical_json(payload),
            user_key(user_id),
            seq,
        )

    async def replace(self, entry: AuditEntry) -> None:
        await self._run(
            "UPDATE loom_audit SET payload = $1, payload_digest = $5, payload_salt = $6, "
            "hash = $2 WHERE user_key = $3 AND seq = $4",
            canonical_json(entry.payload),
            entry.hash,
            user_key(entry.user_id),
            entry.seq,
            entry.payload_digest,
            entry.payload_salt,
        )

    async def delete(self, user_id: str | None, seq: int) -> None:
        await self._run(
            "DELETE FROM loom_audit WHERE user_key = $1 AND seq = $2", user_key(user_id), seq
        )

    async def swap(self, user_id: str | None, seq_a: int, seq_b: int) -> None:
        key = user_key(user_id)
        await self._run(
            "WITH moved AS (UPDATE loom_audit SET seq = -seq WHERE user_key = $1 "
            "AND seq IN ($2, $3) RETURNING 1) SELECT count(*) FROM moved",
            key,
            seq_a,
            seq_b,
        )
        # One statement reads one snapshot: each row takes the other's content at once.
        await self._run(
            "UPDATE loom_audit a SET (seq, time_us, payload, prev_hash, hash, payload_digest, "
            "payload_salt) = (-b.seq, b.time_us, b.payload, b.prev_hash, b.hash, "
            "b.payload_digest, b.payload_salt) FROM loom_audit b "
            "WHERE a.user_key = $1 AND b.user_key = $1 AND a.seq < 0 AND b.seq < 0 "
            "AND a.seq <> b.seq",
            key,
        )


@pytest.mark.postgres
class TestPostgres(AuditStoreConformance):
    @pytest.fixture
    async def make_store(self, pg_dsn: str) -> AsyncIterator[StoreFactory]:
        opened: list[AuditStore] = []

        async def factory() -> AuditStore:
            store = PostgresAuditStore(pg_dsn)
            opened.append(store)
            return store

        yield factory
        for store in opened:
            await store.close()

    @pytest.fixture
    def tamper(self, pg_dsn: str) -> PostgresTamper:
        return PostgresTamper(pg_dsn)
