"""The audit log as a JSON-lines file: one exported entry per line, readable with ``jq``.

Appends from several processes take an exclusive ``flock`` on ``<file>.lock``. The head of every
user's chain is kept in ``<file>.heads`` together with the file size it describes, rewritten
(atomically, by rename) after each append: the heads are what reveal a truncated tail, and the
size lets the next writer adopt lines that a crashed writer appended without updating the
heads, or cut off a line it left half-written.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import AuditIntegrityError
from ._entry import GENESIS, AuditEntry, AuditRecord, user_key
from ._store import AuditFilter, AuditStore, ChainHead, ChainItem, ChainProblem

__all__ = ["JsonlAuditStore"]

log = logging.getLogger("loomflow.audit")


class JsonlAuditStore(AuditStore):
    """Audit entries appended to a JSONL file (positions are 1-based line numbers).

    Args:
        path: The log file; ``<path>.heads`` and ``<path>.lock`` are kept beside it.
        fsync: Flush every append to disk before returning (power-loss safe).

    A file offers no append-only guarantee of its own: ``verify()`` finds edits, deletions,
    reordering and truncation, but keep the file where only loomflow's processes can write.
    """

    backend = "jsonl"
    head_written_atomically = False

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.heads_path = self.path.with_name(self.path.name + ".heads")
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"JsonlAuditStore({str(self.path)!r})"

    async def prepare(self) -> bool:
        """Create the log and its heads file if missing, and check that the heads are readable
        and describe no more than the file holds (``loomflow migrate`` runs this).

        Returns whether the log file was created.

        Raises:
            AuditIntegrityError: the heads file is unreadable, or the log is shorter than it says.
        """
        return await asyncio.to_thread(self._prepare_sync)

    def _prepare_sync(self) -> bool:
        with self._locked():
            heads = self._read_heads()
            created = not self.path.exists()
            if created:
                self.path.touch(mode=0o640)
            size = self.path.stat().st_size
            if size < int(heads["size"]):
                raise AuditIntegrityError(
                    f"{self.path} is {size} bytes, shorter than the {heads['size']} bytes already "
                    "recorded: entries were removed; run `loomflow audit verify`"
                )
            if not self.heads_path.exists():
                # Lines written before the heads existed are taken in, as an append would.
                heads["size"] = self._adopt_tail(heads, size) if size else 0
                self._write_heads(heads)
            return created

    # -- files ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A fresh descriptor per holder: flock excludes other descriptors, so threads of this
        # process queue here exactly like other processes do.
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _read_heads(self) -> dict[str, Any]:
        try:
            data = json.loads(self.heads_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {"size": 0, "users": {}}
        except ValueError as exc:
            raise AuditIntegrityError(f"{self.heads_path} is unreadable: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("users"), dict):
            raise AuditIntegrityError(f"{self.heads_path} is not a heads file")
        return data

    def _write_heads(self, heads: dict[str, Any]) -> None:
        tmp = self.heads_path.with_name(self.heads_path.name + f".{os.getpid()}.tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            json.dump(heads, fh, ensure_ascii=False, separators=(",", ":"))
            fh.flush()
            if self.fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, self.heads_path)
        if self.fsync:
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _adopt_tail(self, heads: dict[str, Any], size: int) -> int:
        """Take in lines written after the heads were last saved; cut a torn last line."""
        start = int(heads["size"])
        with self.path.open("rb") as fh:
            fh.seek(start)
            tail = fh.read(size - start)
        complete = tail.rfind(b"\n") + 1
        if complete < len(tail):
            log.warning(
                "%s ends in a half-written line (%d bytes) left by a crashed writer; cut it off",
                self.path,
                len(tail) - complete,
            )
            os.truncate(self.path, start + complete)
        for raw in tail[:complete].splitlines():
            try:
                entry = AuditEntry.from_json(json.loads(raw))
            except ValueError:
                continue  # verify() reports unreadable lines
            heads["users"][user_key(entry.user_id)] = {
                "user_id": entry.user_id,
                "seq": entry.seq,
                "hash": entry.hash,
            }
        return start + complete

    def _append_sync(self, key: str, records: Sequence[AuditRecord]) -> list[AuditEntry]:
        with self._locked():
            heads = self._read_heads()
            size = self.path.stat().st_size if self.path.exists() else 0
            if size < int(heads["size"]):
                raise AuditIntegrityError(
                    f"{self.path} is {size} bytes, shorter than the {heads['size']} bytes already "
                    "recorded: entries were removed; run `loomflow audit verify`"
                )
            if size > int(heads["size"]):
                size = self._adopt_tail(heads, size)
            head = heads["users"].get(key)
            seq, prev = (int(head["seq"]), str(head["hash"])) if head else (0, GENESIS)
            now_us = time.time_ns() // 1000
            entries = []
            for record in records:
                seq += 1
                entry = AuditEntry.seal(record, seq=seq, time_us=now_us, prev_hash=prev)
                prev = entry.hash
                entries.append(entry)
            data = "".join(e.to_line() + "\n" for e in entries).encode("utf-8")
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            try:
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            heads["size"] = size + len(data)
            heads["users"][key] = {"user_id": records[0].user_id, "seq": seq, "hash": prev}
            self._write_heads(heads)
        return entries

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """Complete lines with their 1-based numbers (a line being written is left out)."""
        try:
            fh = self.path.open("rb")
        except FileNotFoundError:
            return
        with fh:
            for number, raw in enumerate(fh, start=1):
                if raw.endswith(b"\n"):
                    yield number, raw

    def _readable(self, after: int) -> Iterator[tuple[int, AuditEntry]]:
        """Entries on lines after line ``after``; unreadable lines are skipped (verify reports
        them)."""
        for number, raw in self._lines():
            if number <= after:
                continue
            try:
                entry = AuditEntry.from_json(json.loads(raw))
            except ValueError:
                continue
            yield number, entry

    # -- the store interface ----------------------------------------------------------------

    async def _append_chain(self, key: str, records: Sequence[AuditRecord]) -> list[AuditEntry]:
        return await asyncio.to_thread(self._append_sync, key, records)

    async def _query(
        self, where: AuditFilter, limit: int, after: int | None
    ) -> tuple[list[AuditEntry], int | None]:
        def scan() -> tuple[list[AuditEntry], int | None]:
            found: list[AuditEntry] = []
            last = None
            for number, entry in self._readable(after or 0):
                if where.matches(entry):
                    found.append(entry)
                    last = number
                    if len(found) == limit:
                        break
            return found, last

        return await asyncio.to_thread(scan)

    async def _count(self, where: AuditFilter) -> int:
        def scan() -> int:
            return sum(where.matches(entry) for _, entry in self._readable(0))

        # One pass over the file: the default would re-read it from the top for every page.
        return await asyncio.to_thread(scan)

    async def _chain_items(self, only: str | None) -> AsyncIterator[ChainItem]:
        def scan() -> list[tuple[str, int, int, AuditEntry | ChainProblem]]:
            items: list[tuple[str, int, int, AuditEntry | ChainProblem]] = []
            for number, raw in self._lines():
                try:
                    entry = AuditEntry.from_json(json.loads(raw))
                except (ValueError, TypeError) as exc:
                    problem = ChainProblem(
                        None, "unreadable", None, number, f"line {number} is not an entry: {exc}"
                    )
                    items.append(("", -1, number, problem))
                    continue
                key = user_key(entry.user_id)
                if only is None or key == only:
                    items.append((key, entry.seq, number, entry))
            items.sort(key=lambda item: (item[0], item[1], item[2]))
            return items

        for key, _seq, number, item in await asyncio.to_thread(scan):
            yield key, number, item

    async def _heads(self, only: str | None) -> dict[str, ChainHead]:
        heads = await asyncio.to_thread(self._read_heads)
        return {
            key: ChainHead(h.get("user_id"), int(h["seq"]), str(h["hash"]))
            for key, h in heads["users"].items()
            if only is None or key == only
        }
