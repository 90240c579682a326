"""The JSONL store after damage, crashes and failed writes.

Damage is pinned on the users whose chains it breaks: their appends are refused, everyone
else's go on, and ``verify`` reports it. A crashed append is told apart from lines added behind
the store's back by the intent recorded before the lines are written. Crashes are real process
deaths (``os._exit`` at a chosen point in a child process); a full disk is ``/dev/full`` and a
short write is a real file size limit (``RLIMIT_FSIZE``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loomflow.audit import AuditEntry, AuditRecord, JsonlAuditStore, verify_lines
from loomflow.errors import AuditError, AuditIntegrityError


def rec(user: str, **payload: object) -> AuditRecord:
    return AuditRecord(user_id=user, actor="t", action="test.x", payload=payload)


async def _two_users(path: Path) -> JsonlAuditStore:
    store = JsonlAuditStore(path)
    for i in range(3):
        await store.append([rec("alice", i=i), rec("bob", i=i)])
    return store


def _problems(report: object) -> list[tuple[str | None, str, int | None]]:
    return [(p.user_id, p.kind, p.seq) for p in report.problems]  # type: ignore[attr-defined]


async def test_a_deleted_middle_line_stops_only_its_user(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    lines = path.read_text().splitlines(keepends=True)
    assert json.loads(lines[3])["user_id"] == "bob"
    del lines[3]  # bob's entry 2
    path.write_text("".join(lines))
    (entry,) = await store.append(rec("alice"))
    assert entry.seq == 4
    with pytest.raises(
        AuditIntegrityError, match=r"user 'bob' .* is damaged \(missing: entry 2 is missing"
    ):
        await store.append(rec("bob"))
    (carol,) = await store.append(rec("carol"))  # a new user is not held up either
    assert carol.seq == 1
    with pytest.raises(AuditIntegrityError, match="bob"):  # and it stays refused
        await JsonlAuditStore(path).append(rec("bob"))
    report = await store.verify()
    assert _problems(report) == [("bob", "missing", 2)]


async def test_a_truncated_file_stops_only_the_users_it_cut(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]))  # bob's entry 3
    assert [e.seq for e in await store.append([rec("alice"), rec("alice")])] == [4, 5]
    with pytest.raises(
        AuditIntegrityError, match=r"'bob' .* damaged \(truncated: entry 3 is missing at the end"
    ):
        await store.append(rec("bob"))
    report = await store.verify()
    assert _problems(report) == [("bob", "truncated", 3)]


async def test_a_chained_line_added_behind_the_store_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    head = await store.head("alice")
    assert head is not None
    forged = AuditEntry.seal(rec("alice", forged=True), seq=4, time_us=1, prev_hash=head.hash)
    with path.open("a") as fh:
        fh.write(forged.to_line() + "\n")
    report = await store.verify()
    assert _problems(report) == [("alice", "unanchored", 4)]
    with pytest.raises(
        AuditIntegrityError, match=r"'alice' .* damaged \(unanchored: entry 4 comes after"
    ):
        await store.append(rec("alice"))
    (entry,) = await store.append(rec("bob"))
    assert entry.seq == 4
    assert _problems(await store.verify()) == [("alice", "unanchored", 4)]


def _edit_heads(store: JsonlAuditStore, edit: str, spelling: str) -> None:
    """Change alice's head in the heads file as a person with an editor would."""
    raw = store.heads_path.read_text(encoding="utf-8")
    heads = json.loads(raw)
    lines = store.path.read_text(encoding="utf-8").splitlines()
    second = json.loads([line for line in lines if '"user_id":"alice"' in line][1])
    if edit == "removed":
        del heads["users"]['"alice"']
    else:  # moved back to entry 2, hash and all: consistent, but not the end of the trail
        heads["users"]['"alice"'] |= {"seq": 2, "hash": second["hash"]}
    if spelling == "compact":  # the stale digest stays at the end
        text = json.dumps(heads, ensure_ascii=False, separators=(",", ":"))
    else:  # re-serialised by another tool: no digest where the store writes it
        text = json.dumps({k: v for k, v in heads.items() if k != "digest"}, indent=2)
    store.heads_path.write_text(text, encoding="utf-8")


@pytest.mark.parametrize("spelling", ["compact", "rewritten"])
@pytest.mark.parametrize("edit", ["removed", "lowered"])
async def test_a_head_changed_in_the_heads_file_stops_only_its_user(
    tmp_path: Path, edit: str, spelling: str
) -> None:
    # An append after a head was removed or moved back would write a second seq 1 (or 3)
    # and fork the chain; the heads file's digest gives the edit away.
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    _edit_heads(store, edit, spelling)
    before = path.read_bytes()
    why = "no head is recorded" if edit == "removed" else "entry 3 comes after the recorded"
    with pytest.raises(AuditIntegrityError, match=rf"'alice' .* damaged \(unanchored: {why}") as e:
        await store.append(rec("alice"))
    assert "restore the file and its .heads from a backup" in str(e.value)
    if spelling == "compact":
        assert "audit.jsonl.heads was changed behind the store's back" in str(e.value)
    assert path.read_bytes() == before  # no second entry claims a seq of alice's
    (bob,) = await store.append(rec("bob"))  # everyone else goes on
    assert bob.seq == 4
    (carol,) = await store.append(rec("carol"))
    assert carol.seq == 1
    with pytest.raises(AuditIntegrityError, match="alice"):  # and it stays refused
        await JsonlAuditStore(path).append(rec("alice"))
    with pytest.raises(AuditIntegrityError, match="alice"):
        await store.erase("alice", reason="forget")
    report = await store.verify()
    assert [(p.user_id, p.kind) for p in report.problems] == [("alice", "unanchored")]


async def test_a_damaged_mark_removed_from_the_heads_file_comes_back(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    _edit_heads(store, "removed", "compact")
    with pytest.raises(AuditIntegrityError):
        await store.append(rec("alice"))
    heads = json.loads(store.heads_path.read_text(encoding="utf-8"))
    del heads["damaged"]  # the digest at the end is now stale
    store.heads_path.write_text(json.dumps(heads, separators=(",", ":")), encoding="utf-8")
    with pytest.raises(AuditIntegrityError, match=r"'alice' .* damaged \(unanchored"):
        await store.append(rec("alice"))


async def test_a_heads_file_of_an_older_loomflow_is_checked_once_and_sealed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    heads = json.loads(store.heads_path.read_text(encoding="utf-8"))
    del heads["digest"]  # as written before the heads were sealed (KeyError if they are not)
    store.heads_path.write_text(json.dumps(heads), encoding="utf-8")
    (entry,) = await store.append(rec("alice"))  # consistent with the file: no damage
    assert entry.seq == 4
    assert json.loads(store.heads_path.read_text(encoding="utf-8"))["digest"]
    assert (await store.verify()).ok


async def test_a_fragment_added_behind_the_store_does_not_glue_to_the_next_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    with path.open("a") as fh:
        fh.write('{"user_id": "alice", "se')
    (entry,) = await store.append(rec("alice"))
    assert entry.seq == 4
    report = await store.verify()
    assert [(p.kind, p.position) for p in report.problems] == [("unreadable", 7)]
    assert report.entries == 7


async def test_verify_reports_a_fragment_before_an_append_ends_it(tmp_path: Path) -> None:
    """Bytes left after the last newline were passed over until the next append ended them
    with one: verify said OK, then FAILED, with nothing changed in between."""
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    with path.open("a") as fh:
        fh.write('{"user_id": "alice", "se')
    report = await store.verify()
    assert [(p.kind, p.position) for p in report.problems] == [("unreadable", 7)]
    await store.append(rec("alice"))
    after = await store.verify()
    assert [(p.kind, p.position) for p in after.problems] == [("unreadable", 7)]


async def test_verify_reads_a_last_entry_that_lost_only_its_newline(tmp_path: Path) -> None:
    """The next append ends such a line and keeps the entry: verify called it cut off."""
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    path.write_bytes(path.read_bytes()[:-1])
    report = await store.verify()
    assert report.ok, report.problems
    assert report.entries == 6
    (entry,) = await store.append(rec("bob"))
    assert entry.seq == 4
    assert (await store.verify()).ok


_CHILD = textwrap.dedent(
    """
    import asyncio, os, resource, signal, sys
    from loomflow.audit import AuditRecord, JsonlAuditStore

    path, mode = sys.argv[1], sys.argv[2]
    store = JsonlAuditStore(path)
    write_heads, write = store._write_heads, os.write

    def heads_then_die(heads):
        write_heads(heads)
        if "pending" in heads:
            os._exit(9)  # the intent is recorded, no line is written

    def die_before_commit(heads):
        if "pending" not in heads:
            os._exit(9)  # the lines are written, the heads do not record them
        write_heads(heads)

    def half_then_die(fd, data):
        write(fd, bytes(data[: len(data) // 2]))
        os._exit(9)

    if mode == "after-intent":
        store._write_heads = heads_then_die
    elif mode == "after-lines":
        store._write_heads = die_before_commit
    elif mode == "mid-lines":
        os.write = half_then_die
    elif mode == "file-size-limit":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
        limit = os.path.getsize(path) + 100  # room for part of the first line only
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    async def main():
        records = [AuditRecord(user_id="alice", actor="t", action="x", payload={"pad": "p" * 300})]
        try:
            await store.append(records * 2)
        except Exception as exc:
            print(f"{type(exc).__name__}: {exc}")
            sys.exit(3)

    asyncio.run(main())
    """
)


def _child(path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("mode", "kept"),
    [("after-intent", 0), ("mid-lines", 0), ("after-lines", 2)],
)
async def test_an_append_whose_process_died_counts_whole_or_not_at_all(
    tmp_path: Path, mode: str, kept: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    before = path.read_bytes()
    died = _child(path, mode)
    assert died.returncode == 9, died.stderr
    report = await store.verify()  # before any append repairs anything
    assert report.ok, report.problems
    assert report.entries == 6 + kept
    (entry,) = await store.append(rec("alice", after=True))
    assert entry.seq == 4 + kept
    report = await store.verify()
    assert report.ok, report.problems
    assert report.warnings == []
    assert report.entries == 7 + kept
    assert path.read_bytes().startswith(before)
    if mode == "mid-lines":
        assert "mid-write" in caplog.text
    if mode == "after-lines":
        assert "adopted" in caplog.text


async def test_a_short_write_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    before = path.read_bytes()
    failed = _child(path, "file-size-limit")
    assert failed.returncode == 3, failed.stderr
    assert failed.stdout.startswith("AuditError: cannot append to the audit log")
    assert path.read_bytes() == before  # no torn line left behind
    (entry,) = await store.append(rec("alice"))
    assert entry.seq == 4
    assert (await store.verify()).ok


async def test_a_full_disk_is_an_audit_error(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.symlink_to("/dev/full")  # every write fails with ENOSPC
    store = JsonlAuditStore(path)
    with pytest.raises(AuditError, match="No space left on device") as failed:
        await store.append(rec("alice"))
    assert isinstance(failed.value.__cause__, OSError)
    assert json.loads(store.heads_path.read_text())["users"] == {}
    with pytest.raises(AuditError, match="No space left"):  # and again, not a damaged trail
        await store.append(rec("alice"))


async def test_an_unreadable_mark_in_the_stores_own_file_is_no_field_of_an_entry(
    tmp_path: Path,
) -> None:
    # The "unreadable" key marks, in an export, an entry whose row could not be read; no hash
    # covers it. In a JSONL store's own file no writer puts it there: a line given one is a
    # line no writer made, as one with any other unknown key is, not an intact entry.
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    lines = path.read_text().splitlines(keepends=True)
    marked = json.loads(lines[2]) | {"unreadable": "x"}
    lines[2] = json.dumps(marked) + "\n"
    path.write_text("".join(lines))
    report = await JsonlAuditStore(path).verify()
    assert [p.kind for p in report.problems] == ["unreadable", "missing"], report.problems
    await store.close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda line: line.replace(b'"actor":"t"', b'"actor":"\xff"', 1),  # a byte that is not UTF-8
        lambda line: line[:50] + b"\n",  # cut short
        lambda line: line.replace(b'"seq":1', b'"seq":"one"', 1),  # still names its user
    ],
    ids=["not utf-8", "cut short", "text seq"],
)
async def test_a_line_that_is_no_entry_is_marked_in_a_query_and_an_export(
    tmp_path: Path, damage: object
) -> None:
    # A query left such a line out without a word (alice's page began at her entry 2), and an
    # export of any user was refused (exit 1, nothing written) while the file held one. Both
    # now go on past it and mark it in its place, as the SQL stores do with a damaged row.
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    await store.close()
    lines = path.read_bytes().splitlines(keepends=True)
    assert json.loads(lines[0])["user_id"] == "alice"
    lines[0] = damage(lines[0])  # type: ignore[operator]
    path.write_bytes(b"".join(lines))
    damaged = JsonlAuditStore(path)
    page = await damaged.query(user_id="alice")
    assert [e.seq for e in page.entries] == [2, 3]
    assert [(p.kind, p.position) for p in page.damaged] == [("unreadable", 1)]
    assert "line 1 is not an entry" in page.damaged[0].detail
    out = tmp_path / "alice.jsonl"
    heard: list[str] = []
    count = await damaged.export(out, user_id="alice", on_damaged=lambda p: heard.append(p.detail))
    assert count == 2
    assert len(heard) == 1
    exported = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert [("hash" in e, e.get("row")) for e in exported] == [
        (False, 1),
        (True, None),
        (True, None),
    ]
    assert (await damaged.count(user_id="alice")) == 3  # what an export's progress counts
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "loomflow", "audit", "--audit-url", f"jsonl:///{path}", "export"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert [("row" in json.loads(line)) for line in done.stdout.splitlines()] == [True] + [
        False
    ] * 5
    assert "damaged audit row: row 1 of the trail of " in done.stderr, done.stderr
    assert "line 1 is not an entry" in done.stderr
    assert "Traceback" not in done.stderr
    # The file and its export still fail verification.
    report = await damaged.verify()
    assert [p.kind for p in report.problems] == ["unreadable", "missing"]
    with out.open(encoding="utf-8", errors="surrogateescape") as fh:
        assert "unreadable" in {p.kind for p in verify_lines(fh, user_id="alice").problems}
    await damaged.close()


async def test_a_damaged_line_that_names_another_user_stays_out_of_an_export(
    tmp_path: Path,
) -> None:
    # What can be read of a line still rules it out: bob's line with a text seq is not marked
    # in alice's export (or looked up as her entry), only where it may belong.
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    await store.close()
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"seq":1', b'"seq":"one"', 1)
    path.write_bytes(b"".join(lines))
    damaged = JsonlAuditStore(path)
    assert (await damaged.query(user_id="alice")).damaged == []
    assert (await damaged.entry("alice", 1)) is not None
    assert [(p.user_id, p.seq) for p in (await damaged.query(user_id="bob")).damaged] == [
        ("bob", None)
    ]
    done = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "loomflow",
            "audit",
            "--audit-url",
            f"jsonl:///{path}",
            "query",
            "--user",
            "alice",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "damaged" not in json.loads(done.stdout)
    await damaged.close()


async def test_a_hold_line_cut_short_is_not_read_as_no_hold(tmp_path: Path) -> None:
    # Reading the holds passed over a line that is no entry: bob's hold, its line cut short
    # by hand, read as no hold, and what checks it (a forget of his checkpoints, a journal
    # prune, retention) went ahead. Such a line may be a hold: the check now says so.
    path = tmp_path / "audit.jsonl"
    store = await _two_users(path)
    await store.place_hold("bob", reason="litigation")
    await store.close()
    raw = path.read_bytes().splitlines(keepends=True)
    assert json.loads(raw[-1])["action"] == "legal_hold.placed"
    raw[-1] = raw[-1][:60] + b"\n"
    path.write_bytes(b"".join(raw))
    damaged = JsonlAuditStore(path)
    with pytest.raises(AuditIntegrityError, match="is not an entry"):
        await damaged.check_not_held("bob")
    with pytest.raises(AuditIntegrityError, match="is not an entry"):
        await damaged.legal_holds()
    await damaged.close()
