"""An audit store in process memory: for tests of your own agents, and for demos.

It keeps the same chain, head and verification rules as the durable backends, so a test can
assert on ``store.all_entries`` and still call ``verify()``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from ._entry import DIGESTED_VERSION, GENESIS, AuditEntry, AuditRecord, user_key
from ._store import AuditFilter, AuditStore, ChainHead, ChainItem
from .actions import KEPT_BY_ERASURE

__all__ = ["InMemoryAuditStore"]


class InMemoryAuditStore(AuditStore):
    """Entries in a list; positions are list indexes.

    Example:
        >>> store = InMemoryAuditStore()
        >>> agent = Agent("...", model=model, audit=AuditLog(store))
        >>> [e.action for e in store.all_entries]
        ['run.start', 'model.start', 'model.call', 'run.end']
    """

    backend = "memory"

    def __init__(self) -> None:
        self.all_entries: list[AuditEntry] = []
        self._heads_by_key: dict[str, ChainHead] = {}

    def __repr__(self) -> str:
        return f"InMemoryAuditStore({len(self.all_entries)} entries)"

    async def _append_chain(self, key: str, records: Sequence[AuditRecord]) -> list[AuditEntry]:
        # No await between reading the head and storing the entries: atomic on the event loop.
        head = self._heads_by_key.get(key)
        seq, prev = (head.seq, head.hash) if head is not None else (0, GENESIS)
        out = []
        for record in records:
            seq += 1
            entry = AuditEntry.seal(record, seq=seq, time_us=time.time_ns() // 1000, prev_hash=prev)
            prev = entry.hash
            out.append(entry)
        self.all_entries.extend(out)
        self._heads_by_key[key] = ChainHead(records[0].user_id, seq, prev)
        return out

    async def _query(
        self, where: AuditFilter, limit: int, after: int | None
    ) -> tuple[list[AuditEntry], int | None]:
        found: list[AuditEntry] = []
        last = None
        for position in range(0 if after is None else after + 1, len(self.all_entries)):
            entry = self.all_entries[position]
            if where.matches(entry):
                found.append(entry)
                last = position
                if len(found) == limit:
                    break
        return found, last

    async def _chain_items(self, only: str | None) -> AsyncIterator[ChainItem]:
        items = [
            (user_key(e.user_id), e.seq, position, e)
            for position, e in enumerate(self.all_entries)
            if only is None or user_key(e.user_id) == only
        ]
        items.sort(key=lambda item: (item[0], item[1], item[2]))
        for key, _seq, position, entry in items:
            yield key, position, entry

    async def _heads(self, only: str | None) -> dict[str, ChainHead]:
        return {k: h for k, h in self._heads_by_key.items() if only is None or k == only}

    async def _tombstone(
        self,
        key: str,
        below_seq: int,
        before_us: int | None,
        old_seqs: Sequence[int],
        *,
        sweep: bool = True,
    ) -> int:
        old = set(old_seqs)
        erased = 0
        for position, entry in enumerate(self.all_entries):
            if (
                user_key(entry.user_id) != key
                or entry.seq >= below_seq
                or entry.payload is None
                or entry.action in KEPT_BY_ERASURE
            ):
                continue
            if not _taken(entry, before_us, old, sweep):
                continue
            self.all_entries[position] = entry.tombstoned()
            erased += 1
        return erased


def _taken(entry: AuditEntry, before_us: int | None, old: set[int], sweep: bool) -> bool:
    """Whether erasure takes this (live, early enough) entry: listed, or swept by time."""
    if entry.seq in old:
        return True
    return (
        sweep
        and entry.hash_version >= DIGESTED_VERSION
        and (before_us is None or entry.time_us < before_us)
    )
