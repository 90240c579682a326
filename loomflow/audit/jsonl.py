"""The audit log as a JSON-lines file: one exported entry per line, readable with ``jq``.

Appends from several processes take an exclusive ``flock`` on ``<file>.lock``. Beside the file,
``<file>.heads`` records every user's chain head, the file size those heads describe and where
the last line starts, and is rewritten (atomically, by rename) around each append:

1. the append's intent is recorded first: where its bytes will go and their SHA-256;
2. the lines are written (all of them, or none: a failed write is cut off again);
3. the new heads and size are recorded, and the intent dropped.

So the next writer can tell a crashed append's lines (they match the intent: adopted, or cut
if the crash left them half-written) from lines someone else added, and it notices a file that
shrank or changed at its end. The heads file ends with the SHA-256 of the rest of it
(``"digest"``), so a head removed or moved back by hand is noticed too, before an append could
fork that user's chain. Such damage is pinned on the users whose chains it breaks: their
appends are refused from then on (``AuditIntegrityError``), everyone else's go on, and
``verify()`` reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import AuditError, AuditIntegrityError
from ._entry import (
    DIGESTED_VERSION,
    GENESIS,
    AuditEntry,
    AuditRecord,
    unreadable_reason,
    user_key,
)
from ._store import (
    AuditFilter,
    AuditStore,
    ChainHead,
    ChainItem,
    ChainProblem,
    VerifyReport,
    _ChainCheck,
)
from .actions import KEPT_BY_ERASURE

__all__ = ["JsonlAuditStore"]

log = logging.getLogger("loomflow.audit")

# The heads file is the JSON object of the heads with, as its last key, the SHA-256 of that
# object's bytes without it. It is checked over the bytes as read, with no second
# serialisation: for 10,000 users' heads (1.5 MB) hashing takes ~1 ms per read or write,
# where serialising them takes ~12 ms and parsing ~8 (measured on a 2-core machine).
_SEAL = re.compile(rb',"digest":"([0-9a-f]{64})"\}\s*\Z')


class JsonlAuditStore(AuditStore):
    """Audit entries appended to a JSONL file (positions are 1-based line numbers).

    Args:
        path: The log file; ``<path>.heads`` and ``<path>.lock`` are kept beside it.
        fsync: Flush every append to disk before returning (power-loss safe).

    A file offers no append-only guarantee of its own: ``verify()`` finds edits, deletions,
    reordering, truncation and lines added behind the store's back, but keep the file where
    only loomflow's processes can write.
    """

    backend = "jsonl"

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.heads_path = self.path.with_name(self.path.name + ".heads")
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"JsonlAuditStore({str(self.path)!r})"

    def _own_files(self) -> tuple[Path, ...]:
        return (self.path, self.heads_path, self.lock_path)

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
            heads, intact = self._read_heads_checked()
            created = not self.path.exists()
            if created:
                self.path.touch(mode=0o640)
            size = self.path.stat().st_size
            # A heads file changed by hand is not rewritten (sealed) here: the next append
            # finds whose trail it breaks.
            if "rewrite" in heads and intact is not False:  # an erasure stopped around its rename
                self._settle_rewrite(heads, size)
                self._write_heads(heads)
            if size < int(heads["size"]):
                raise AuditIntegrityError(
                    f"{self.path} is {size} bytes, shorter than the {heads['size']} bytes already "
                    "recorded: entries were removed; run `loomflow audit verify`"
                )
            if not self.heads_path.exists():
                if size:
                    # Lines no heads file vouches for may have been written by anyone: adopting
                    # them here would launder a forged trail.
                    raise AuditIntegrityError(
                        f"{self.path} holds entries but its heads file {self.heads_path} is "
                        "missing: restore it, or check the file with `loomflow audit verify --file`"
                    )
                self._write_heads(heads)
            return created

    # -- files ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, mode: int = fcntl.LOCK_EX) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A fresh descriptor per holder: flock excludes other descriptors, so threads of this
        # process queue here exactly like other processes do.
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _read_heads(self) -> dict[str, Any]:
        return self._read_heads_checked()[0]

    def _read_heads_checked(self) -> tuple[dict[str, Any], bool | None]:
        """The heads, and whether the file is as this store last wrote it: ``True``, ``False``
        (its digest does not match: changed by hand), or ``None`` (no digest: written by a
        loomflow before 0.21, or no heads file yet while the log is not empty)."""
        try:
            raw = self.heads_path.read_bytes()
        except FileNotFoundError:
            return {"size": 0, "users": {}}, None if self._size() else True
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise AuditIntegrityError(f"{self.heads_path} is unreadable: {exc}") from exc
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("users"), dict)
            or not isinstance(data.get("size"), int)
        ):
            raise AuditIntegrityError(f"{self.heads_path} is not a heads file")
        for key, head in data["users"].items():
            # Each head is read as (seq, hash): an edited one is the file's damage to report,
            # not a ValueError in a verify or in the next run's append.
            if (
                not isinstance(head, dict)
                or type(head.get("seq")) is not int
                or not isinstance(head.get("hash"), str)
            ):
                raise AuditIntegrityError(
                    f"{self.heads_path} is unreadable: the head of user key {key[:80]!r} is "
                    f"{str(head)[:80]!r}, not a seq number and a hash"
                )
        data.pop("digest", None)
        sealed = _SEAL.search(raw, max(0, len(raw) - 100))  # only its end can hold the seal
        if sealed is None:
            return data, None
        body = raw[: sealed.start()] + b"}"
        return data, hashlib.sha256(body).hexdigest() == sealed.group(1).decode("ascii")

    def _write_heads(self, heads: dict[str, Any]) -> None:
        tmp = self.heads_path.with_name(self.heads_path.name + f".{os.getpid()}.tmp")
        body = json.dumps(
            {k: v for k, v in heads.items() if k != "digest"},
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode("utf-8")
        digest = hashlib.sha256(body).hexdigest().encode("ascii")
        try:
            with os.fdopen(_replacement(tmp, self.heads_path), "wb") as fh:
                fh.write(body[:-1] + b',"digest":"' + digest + b'"}')
                fh.flush()
                if self.fsync:
                    os.fsync(fh.fileno())
            os.replace(tmp, self.heads_path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def _read(self, start: int, end: int) -> bytes:
        with self.path.open("rb") as fh:
            fh.seek(start)
            return fh.read(end - start)

    def _last_line_ok(self, heads: dict[str, Any], size: int) -> bool:
        """Whether the file still ends with the line the heads say was written last."""
        last = heads.get("last")
        if not isinstance(last, dict):
            return size == 0 or "last" not in heads  # heads files of 0.1 do not record it
        start = last.get("start")
        if not isinstance(start, int) or not 0 <= start < size:
            return False
        raw = self._read(start, size)
        return raw.endswith(b"\n") and hashlib.sha256(raw).hexdigest() == last.get("sha256")

    @staticmethod
    def _adopt(heads: dict[str, Any], raw: bytes, start: int) -> None:
        """Record the lines ``raw`` (written at ``start``, ending in a newline) in ``heads``."""
        lines = raw.splitlines(keepends=True)
        for line in lines:
            entry = AuditEntry.from_line(line)
            heads["users"][user_key(entry.user_id)] = {
                "user_id": entry.user_id,
                "seq": entry.seq,
                "hash": entry.hash,
            }
        end = start + len(raw)
        heads["size"] = end
        heads["last"] = {
            "start": end - len(lines[-1]),
            "sha256": hashlib.sha256(lines[-1]).hexdigest(),
        }

    def _settle_pending(self, heads: dict[str, Any], size: int, *, repair: bool) -> int:
        """Finish what an append that stopped half-way left (see the module docstring).

        Returns the size up to which the file is accounted for. With ``repair``, a torn
        append is cut off the file; without (for ``verify``), it is only left out.
        """
        size = self._settle_rewrite(heads, size)
        pending = heads.pop("pending", None)
        if not isinstance(pending, dict):
            return size
        start, end = pending.get("start"), pending.get("end")
        if not isinstance(start, int) or not isinstance(end, int) or start != heads["size"]:
            return size  # not this file's intent: whatever follows the heads is damage
        if size == end:
            raw = self._read(start, end)
            if hashlib.sha256(raw).hexdigest() == pending.get("sha256"):
                # Written in full by a process that died before recording it: it was
                # sealed under the lock from the recorded heads, so it belongs in the chains.
                self._adopt(heads, raw, start)
                log.warning(
                    "%s: adopted %d bytes that an append wrote before its process stopped",
                    self.path,
                    end - start,
                )
                return size
        elif start < size < end:
            # The append never returned, so none of it was acknowledged: it goes as a whole.
            log.warning(
                "%s ends in %d bytes of an append whose process stopped mid-write; %s",
                self.path,
                size - start,
                "cut them off" if repair else "they are left out until the next append",
            )
            if repair:
                os.truncate(self.path, start)
            return start
        return size

    def _settle_rewrite(self, heads: dict[str, Any], size: int) -> int:
        """Finish what an erasure that stopped half-way left: its new file is in place (keep
        the size and last line it recorded) or it is not (the heads still describe the file)."""
        rewrite = heads.pop("rewrite", None)
        if not isinstance(rewrite, dict):
            return size
        new_size, last = rewrite.get("size"), rewrite.get("last")
        if isinstance(new_size, int) and new_size == size:
            candidate = {"size": new_size, "last": last}
            if self._last_line_ok(candidate, size):
                heads["size"], heads["last"] = new_size, last
        return size

    def _settled_heads(self) -> dict[str, Any]:
        """The heads a writer may trust (under the lock): a crashed append or erasure
        finished, and, if the file or the heads file changed behind the store's back, the
        users whose trails that broke marked damaged (see :meth:`_damage`)."""
        heads, intact = self._read_heads_checked()
        size = self._settle_pending(heads, self._size(), repair=True)
        if intact is not True or size != int(heads["size"]) or not self._last_line_ok(heads, size):
            # No digest (a heads file of an older loomflow) costs one pass, once: the heads
            # are sealed when written back.
            self._damage(heads, size, heads_changed=intact is False)
            self._write_heads(heads)
        return heads

    def _damage(self, heads: dict[str, Any], size: int, *, heads_changed: bool = False) -> None:
        """The file does not end where the heads say, or the heads file was changed: find
        whose chains broke, and carry on.

        One full pass over the file. Users whose chain no longer checks out against the
        recorded heads (entries gone, changed, or added behind the store's back; a head
        removed or moved) are marked damaged, so their appends are refused and the damage
        stays in view (an append after a head moved back would fork the chain); the heads
        then describe the file as it is, so every other user can go on appending.
        """
        if size and self._read(size - 1, size) != b"\n":
            # A line someone left without its newline: end it, so that the next entry gets a
            # line of its own (``verify`` reports the fragment as unreadable).
            with self.path.open("ab") as fh:
                fh.write(b"\n")
            size += 1
        recorded = {
            key: ChainHead(h.get("user_id"), int(h["seq"]), str(h["hash"]))
            for key, h in heads["users"].items()
        }
        report = VerifyReport()
        items = sorted(self._scan(None, size), key=_chain_order)
        checker: _ChainCheck | None = None
        seen: set[str] = set()
        last: tuple[int, bytes] | None = None
        for key, _seq, number, item in items:
            if isinstance(item, ChainProblem):
                continue  # an unreadable line belongs to nobody
            if checker is None or checker.key != key:
                if checker is not None:
                    checker.finish(recorded.get(checker.key), report, True)
                    checker.finish_erasures(report)
                checker = _ChainCheck(key, item.user_id)
                seen.add(key)
            checker.feed(number, item, report)
        if checker is not None:
            checker.finish(recorded.get(checker.key), report, True)
            checker.finish_erasures(report)
        for key, head in recorded.items():
            if key not in seen:
                report.problems.append(
                    ChainProblem(head.user_id, "truncated", 1, None, "all entries are missing")
                )
        damaged: dict[str, Any] = heads.setdefault("damaged", {})
        for problem in report.problems:
            key = user_key(problem.user_id)
            if key not in damaged:
                detail = problem.detail
                if heads_changed:
                    detail += f", and {self.heads_path.name} was changed behind the store's back"
                damaged[key] = {
                    "user_id": problem.user_id,
                    "problem": problem.kind,
                    "detail": detail[:300],
                }
                log.error(
                    "%s: the audit trail of user %r is damaged (%s: %s); appends for this user "
                    "are refused from now on",
                    self.path,
                    problem.user_id,
                    problem.kind,
                    detail,
                )
        for start, raw in self._line_spans(size):
            last = (start, raw)
        heads["size"] = size
        heads["last"] = (
            None
            if last is None
            else {"start": last[0], "sha256": hashlib.sha256(last[1]).hexdigest()}
        )

    def _line_spans(self, size: int) -> Iterator[tuple[int, bytes]]:
        """Every complete line within the first ``size`` bytes, with its byte offset."""
        offset = 0
        try:
            fh = self.path.open("rb")
        except FileNotFoundError:
            return
        with fh:
            for raw in fh:
                if offset + len(raw) > size or not raw.endswith(b"\n"):
                    return
                yield offset, raw
                offset += len(raw)

    def _append_sync(self, key: str, records: Sequence[AuditRecord]) -> list[AuditEntry]:
        try:
            return self._append_locked(key, records)
        except OSError as exc:
            # A full disk, a quota, a read-only mount: a typed error, and the file as it was.
            raise AuditError(
                f"cannot append to the audit log {self.path}: {exc.strerror or exc}"
            ) from exc

    def _refuse_damaged(self, heads: dict[str, Any], key: str, user_id: str | None) -> None:
        damage = heads.get("damaged", {}).get(key)
        if damage is not None:
            why = damage.get("problem")
            if isinstance(damage.get("detail"), str):
                why = f"{why}: {damage['detail']}"
            raise AuditIntegrityError(
                f"the audit trail of user {user_id!r} in {self.path} is damaged "
                f"({why}): its appends are refused so that the damage stays in view; run "
                "`loomflow audit verify` and restore the file and its .heads from a backup"
            )

    async def check_appendable(self, user_id: str | None) -> None:
        await self.open()

        def check() -> None:
            with self._locked():
                self._refuse_damaged(self._settled_heads(), user_key(user_id), user_id)

        try:
            await asyncio.to_thread(check)
        except OSError as exc:
            raise AuditError(
                f"cannot read the audit log {self.path}: {exc.strerror or exc}"
            ) from exc

    def _append_locked(self, key: str, records: Sequence[AuditRecord]) -> list[AuditEntry]:
        with self._locked():
            heads = self._settled_heads()
            self._refuse_damaged(heads, key, records[0].user_id)
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
            start = int(heads["size"])
            heads["pending"] = {
                "start": start,
                "end": start + len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
            self._write_heads(heads)
            try:
                self._write_lines(data)
                self._adopt(heads, data, start)
                del heads["pending"]
                self._write_heads(heads)
            except BaseException:
                if self._intent_open():  # the new heads did not land: nor may the lines
                    self._cut(start)
                raise
        return entries

    def _tombstone_sync(
        self, key: str, below_seq: int, before_us: int | None, old_seqs: Sequence[int], sweep: bool
    ) -> int:
        try:
            return self._tombstone_locked(key, below_seq, before_us, set(old_seqs), sweep)
        except OSError as exc:
            raise AuditError(f"cannot erase in the audit log {self.path}: {exc}") from exc

    def _tombstone_locked(
        self, key: str, below_seq: int, before_us: int | None, old_seqs: set[int], sweep: bool
    ) -> int:
        """Rewrite the file with the user's payloads erased, then swap it in by rename.

        The new file's size and last line are recorded in the heads before the rename, so a
        crash on either side of it leaves heads that describe the file in place.
        """
        with self._locked():
            heads = self._settled_heads()
            size = int(heads["size"])
            if key in heads.get("damaged", {}):
                raise AuditIntegrityError(
                    f"the audit trail of user {key} in {self.path} is damaged: restore it "
                    "before erasing"
                )
            for stale in self.path.parent.glob(self.path.name + ".*.erase"):
                stale.unlink(missing_ok=True)  # left by an erasure killed before its rename
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.erase")
            erased = 0
            last: tuple[int, bytes] | None = None
            offset = 0
            try:
                with os.fdopen(_replacement(tmp, self.path), "wb") as out:
                    for _start, raw in self._line_spans(size):
                        entry = _erasable(raw, key, below_seq, before_us, old_seqs, sweep)
                        if entry is not None:
                            raw = (entry.tombstoned().to_line() + "\n").encode("utf-8")
                            erased += 1
                        out.write(raw)
                        last = (offset, raw)
                        offset += len(raw)
                    out.flush()
                    if self.fsync:
                        os.fsync(out.fileno())
                if not erased:
                    tmp.unlink()
                    return 0
                assert last is not None
                new_last = {"start": last[0], "sha256": hashlib.sha256(last[1]).hexdigest()}
                heads["rewrite"] = {"size": offset, "last": new_last}
                self._write_heads(heads)
                os.replace(tmp, self.path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            heads.pop("rewrite")
            heads["size"], heads["last"] = offset, new_last
            self._write_heads(heads)  # also makes the rename durable (fsyncs the folder)
            return erased

    async def _tombstone(
        self,
        key: str,
        below_seq: int,
        before_us: int | None,
        old_seqs: Sequence[int],
        *,
        sweep: bool = True,
    ) -> int:
        return await asyncio.to_thread(
            self._tombstone_sync, key, below_seq, before_us, old_seqs, sweep
        )

    def _write_lines(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            view = memoryview(data)
            while view:  # a write may stop short (a file size limit): go on until it fails
                written = os.write(fd, view)
                view = view[written:]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _intent_open(self) -> bool:
        try:
            return "pending" in self._read_heads()
        except (OSError, AuditIntegrityError):
            return True

    def _cut(self, start: int) -> None:
        """Take a failed append's bytes off the file again, so no torn line stays behind."""
        try:
            if self._size() > start:
                os.truncate(self.path, start)
        except OSError as exc:  # e.g. not a regular file; the recorded intent still covers it
            log.warning("could not cut a failed append off %s: %s", self.path, exc)

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

    def _rows(
        self, after: int, where: AuditFilter
    ) -> Iterator[tuple[int, AuditEntry | ChainProblem]]:
        """The lines after line ``after`` that ``where`` selects: an entry, or for a line that
        is no entry, the ``unreadable`` problem verify reports for it, in its place."""
        for number, raw in self._lines():
            if number <= after:
                continue
            try:
                entry = AuditEntry.from_line(raw)
            except (ValueError, TypeError, RecursionError) as exc:  # as _scan reads it
                # Not skipped: a query or an export that left it out would pass for the whole
                # trail. It is given to every filter that what can be read of it does not
                # rule out (a line with no readable user goes to every user's).
                fields = _fields_of(raw)
                if _may_match(where, fields):
                    yield number, _damaged_line(number, fields, exc)
                continue
            if where.matches(entry):
                yield number, entry

    # -- the store interface ----------------------------------------------------------------

    async def _append_chain(self, key: str, records: Sequence[AuditRecord]) -> list[AuditEntry]:
        return await asyncio.to_thread(self._append_sync, key, records)

    async def _query(
        self, where: AuditFilter, limit: int, after: int | None
    ) -> tuple[list[AuditEntry | ChainProblem], int | None]:
        def scan() -> tuple[list[AuditEntry | ChainProblem], int | None]:
            found: list[AuditEntry | ChainProblem] = []
            last = None
            for number, row in self._rows(after or 0, where):
                found.append(row)
                last = number
                if len(found) == limit:
                    break
            return found, last

        return await asyncio.to_thread(scan)

    async def _count(self, where: AuditFilter) -> int:
        def scan() -> int:
            return sum(1 for _ in self._rows(0, where))

        # One pass over the file: the default would re-read it from the top for every page.
        return await asyncio.to_thread(scan)

    def _scan(self, only: str | None, size: int, *, tail: bool = False) -> list[ScanItem]:
        """The entries (or unreadable lines) within the first ``size`` bytes.

        With ``tail`` (under the lock, so no append is half-done), bytes after the last
        newline are read as a line too: the next append ends them with a newline and keeps
        them, so ``verify`` must not pass over them before it.
        """
        items: list[ScanItem] = []
        spans = list(self._line_spans(size))
        end = spans[-1][0] + len(spans[-1][1]) if spans else 0
        if tail and end < size:
            spans.append((end, self._read(end, size)))
        for number, (_start, raw) in enumerate(spans, start=1):
            try:
                entry = AuditEntry.from_line(raw)
            except (ValueError, TypeError, RecursionError) as exc:  # Recursion: nested too deep
                # Filed under no user and no seq: its own word for them is not taken here.
                items.append(("", -1, number, _damaged_line(number, {}, exc)))
                continue
            key = user_key(entry.user_id)
            if only is None or key == only:
                items.append((key, entry.seq, number, entry))
        return items

    async def _chain_items(self, only: str | None) -> AsyncIterator[ChainItem]:
        for key, _seq, number, item in await asyncio.to_thread(
            lambda: sorted(self._scan(only, self._size()), key=_chain_order)
        ):
            yield key, number, item

    async def _verify_source(
        self, only: str | None
    ) -> tuple[dict[str, ChainHead], AsyncIterator[ChainItem]]:
        def snapshot() -> tuple[dict[str, Any], int]:
            # Under a shared lock no append is half-done, so heads and size agree, except
            # after a writer died mid-append: settled here as the next append would.
            with self._locked(fcntl.LOCK_SH):
                heads = self._read_heads()
                size = self._settle_pending(heads, self._size(), repair=False)
            return heads, size

        heads, size = await asyncio.to_thread(snapshot)
        recorded = {
            key: ChainHead(h.get("user_id"), int(h["seq"]), str(h["hash"]))
            for key, h in heads["users"].items()
            if only is None or key == only
        }

        async def items() -> AsyncIterator[ChainItem]:
            # Lines appended after the snapshot are left for the next verify.
            scanned = await asyncio.to_thread(
                lambda: sorted(self._scan(only, size, tail=True), key=_chain_order)
            )
            for key, _seq, number, item in scanned:
                yield key, number, item

        return recorded, items()

    async def _heads(self, only: str | None) -> dict[str, ChainHead]:
        heads = await asyncio.to_thread(self._read_heads)
        return {
            key: ChainHead(h.get("user_id"), int(h["seq"]), str(h["hash"]))
            for key, h in heads["users"].items()
            if only is None or key == only
        }


ScanItem = tuple[str, int, int, AuditEntry | ChainProblem]
"""``(user_key, seq, line number, entry or problem)``."""


def _fields_of(raw: bytes) -> dict[str, Any]:
    """What can be read of a line that is no entry: its keys, when it is a JSON object."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _text(fields: dict[str, Any], name: str) -> tuple[bool, str | None]:
    """A text (or null) field of a damaged line: whether it can be read, and its value."""
    value = fields.get(name, ...)
    if value is None or isinstance(value, str):
        return True, value
    return False, None


def _may_match(where: AuditFilter, fields: dict[str, Any]) -> bool:
    """Whether a damaged line's readable fields leave it possibly selected by ``where``.

    What cannot be read cannot rule a line out (its time is never trusted). A lookup of one
    entry (``seq``) takes only a line whose seq reads as that number."""
    seq = fields.get("seq")
    if where.seq is not None and not (type(seq) is int and seq == where.seq):
        return False
    known, user = _text(fields, "user_id")
    if where.user_key is not None and known and user_key(user) != where.user_key:
        return False
    for name, wanted in (("session_id", where.session_id), ("run_id", where.run_id)):
        known, value = _text(fields, name)
        if wanted is not None and known and value != wanted:
            return False
    action = fields.get("action")
    if isinstance(action, str):
        if where.action is not None and action != where.action:
            return False
        if where.action_prefix is not None and not action.startswith(where.action_prefix):
            return False
    return True


def _damaged_line(number: int, fields: dict[str, Any], exc: BaseException) -> ChainProblem:
    """A line that is no entry, as verify reports it (the same words), with its user and seq
    as far as they can be read, for a marker in an export."""
    _, user = _text(fields, "user_id")
    seq = fields.get("seq")
    return ChainProblem(
        user,
        "unreadable",
        seq if type(seq) is int else None,
        number,
        f"line {number} is not an entry: {unreadable_reason(exc)}",
    )


def _erasable(
    raw: bytes, key: str, below_seq: int, before_us: int | None, old_seqs: set[int], sweep: bool
) -> AuditEntry | None:
    """The entry on this line if erasure takes its payload (see ``AuditStore._tombstone``)."""
    try:
        entry = AuditEntry.from_line(raw)
    except (ValueError, TypeError, RecursionError):
        return None  # damage stays as it is, for verify to report
    if (
        user_key(entry.user_id) != key
        or entry.seq >= below_seq
        or entry.payload is None
        or entry.action in KEPT_BY_ERASURE
    ):
        return None
    if entry.seq in old_seqs:
        return entry
    if sweep and entry.hash_version >= DIGESTED_VERSION:
        return entry if before_us is None or entry.time_us < before_us else None
    return None


def _chain_order(item: ScanItem) -> tuple[str, int, int]:
    return item[0], item[1], item[2]


def _replacement(tmp: Path, target: Path) -> int:
    """A file descriptor of ``tmp``, made to be renamed over ``target``: with ``target``'s
    mode, so that a mode its operator gave it (``chmod 600``) outlasts the rewrite; 0640
    for a new file."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
    except FileNotFoundError:
        pass
    except BaseException:
        os.close(fd)
        raise
    return fd
