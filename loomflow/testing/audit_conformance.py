"""One conformance suite for every audit store backend.

Subclass :class:`AuditStoreConformance` and provide two fixtures:

- ``make_store``: an async factory whose every call returns a new store over the *same*
  storage (as another worker process would see it);
- ``tamper``: an :class:`AuditTamper` that edits that storage behind the store's back, the way
  an attacker or a careless script would, so the suite can check that ``verify()`` notices.

Example::

    class TestMyStore(AuditStoreConformance):
        @pytest.fixture
        async def make_store(self, tmp_path):
            async def factory():
                return MyStore(tmp_path / "audit")
            return factory

        @pytest.fixture
        def tamper(self, tmp_path):
            return MyTamper(tmp_path / "audit")
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import pytest

from ..audit import GENESIS, HASH_VERSION, AuditEntry, AuditRecord, AuditStore
from ..errors import ReservedActionError, UserError

__all__ = ["AuditStoreConformance", "AuditTamper", "StoreFactory"]

StoreFactory = Callable[[], Awaitable[AuditStore]]


class AuditTamper(Protocol):
    """Edits a backend's storage directly, bypassing the store (and its guards)."""

    async def edit_payload(self, user_id: str | None, seq: int, payload: dict[str, Any]) -> None:
        """Replace an entry's payload, keeping its stored hash."""

    async def replace(self, entry: AuditEntry) -> None:
        """Overwrite the stored entry with ``entry``'s ``seq`` by ``entry`` (hash and all)."""

    async def delete(self, user_id: str | None, seq: int) -> None:
        """Remove one entry."""

    async def swap(self, user_id: str | None, seq_a: int, seq_b: int) -> None:
        """Exchange the storage positions of two entries of one user."""


def rec(user: str | None, action: str = "test.action", **payload: Any) -> AuditRecord:
    """A record for tests."""
    return AuditRecord(
        user_id=user,
        session_id=payload.pop("session", "s1"),
        run_id=payload.pop("run", "r1"),
        actor="tester",
        action=action,
        payload=payload,
    )


def _collect(calls: list[tuple[int, int | None]]) -> Callable[[int, int | None], None]:
    """An ``on_progress`` callback that keeps what it hears."""
    return lambda done, total: calls.append((done, total))


class AuditStoreConformance:
    """Behaviour every audit store must show (see the module docstring)."""

    @pytest.fixture
    async def store(self, make_store: StoreFactory) -> AuditStore:
        return await make_store()

    # -- chains -----------------------------------------------------------------------------

    async def test_each_user_gets_a_gap_free_linked_chain(self, store: AuditStore) -> None:
        written = await store.append(
            [rec("alice", n=1), rec("bob", n=1), rec("alice", n=2), rec(None, n=1)]
        )
        assert [(e.user_id, e.seq) for e in written] == [
            ("alice", 1),
            ("bob", 1),
            ("alice", 2),
            (None, 1),
        ]
        more = await store.append(rec("alice", n=3))
        alice = [e async for e in store.entries(user_id="alice")]
        assert [e.seq for e in alice] == [1, 2, 3]
        assert [(e.payload or {})["n"] for e in alice] == [1, 2, 3]
        assert alice[0].prev_hash == GENESIS
        assert alice[1].prev_hash == alice[0].hash
        assert alice[2] == more[0]
        assert all(e.computed_hash() == e.hash for e in alice)
        head = await store.head("alice")
        assert head is not None
        assert (head.seq, head.hash) == (3, alice[2].hash)
        assert await store.head("nobody") is None

    async def test_the_anonymous_bucket_is_its_own_user(self, store: AuditStore) -> None:
        await store.append([rec(None), rec("null"), rec("None"), rec(None)])
        anonymous = [e async for e in store.entries(user_id=None)]
        assert [(e.user_id, e.seq) for e in anonymous] == [(None, 1), (None, 2)]
        assert [e.user_id async for e in store.entries(user_id="null")] == ["null"]

    async def test_another_worker_continues_the_same_chains(
        self, store: AuditStore, make_store: StoreFactory
    ) -> None:
        await store.append([rec("alice"), rec("alice")])
        other = await make_store()
        (entry,) = await other.append(rec("alice"))
        assert entry.seq == 3
        assert (await store.verify()).ok

    async def test_concurrent_writers_never_fork_a_chain(
        self, store: AuditStore, make_store: StoreFactory
    ) -> None:
        other = await make_store()

        async def writer(target: AuditStore, n: int) -> None:
            for i in range(8):
                await target.append([rec("alice", i=i, w=n), rec(f"user{n % 2}", i=i)])

        await asyncio.gather(*(writer(store if n % 2 else other, n) for n in range(6)))
        seqs = [e.seq async for e in store.entries(user_id="alice")]
        assert seqs == list(range(1, 49))
        report = await store.verify()
        assert report.ok, report.problems
        assert report.entries == 96
        assert report.users == 3

    async def test_payloads_survive_storage_bit_for_bit(self, store: AuditStore) -> None:
        payload: dict[str, Any] = {
            "big": 1e20,
            "small": 5e-324,
            "neg_zero": -0.0,
            "int": 2**63 + 1,
            "text": 'naïve — 日本 \u2028 "quoted" \\ back',
            "nested": {"z": [1, 2.5, None, True], "a": {}},
            "nan": float("nan"),
        }
        (written,) = await store.append(rec("alice", **payload))
        assert written.payload is not None
        assert written.payload["nan"] == "nan"
        assert written.payload["int"] == str(2**63 + 1)  # beyond 2**53: kept exact as text
        (read,) = [e async for e in store.entries(user_id="alice")]
        assert read == written
        assert read.hash_version == HASH_VERSION
        assert read.computed_hash() == read.hash
        assert (await store.verify()).ok

    async def test_ids_no_backend_can_store_are_refused(self, store: AuditStore) -> None:
        with pytest.raises(UserError, match="NUL"):
            await store.append(rec("al\x00ice"))
        with pytest.raises(UserError, match="action"):
            await store.append(AuditRecord(user_id="a", actor="x", action=""))
        assert [e async for e in store.entries()] == []

    async def test_reserved_actions_are_refused_but_holds_still_written(
        self, store: AuditStore
    ) -> None:
        # An application cannot forge a hold, an erasure record or a console look through
        # append(): verification, erasure and the console act on those.
        for action in ("legal_hold.placed", "audit.erasure", "console.view", "LegaI-Hold.placed"):
            with pytest.raises(ReservedActionError) as caught:
                await store.append([rec("alice"), rec("alice", action)])
            assert caught.value.user_id == "alice"
        with pytest.raises(ReservedActionError, match="console chain"):
            await store.append(rec("console:carol"))
        assert [e async for e in store.entries()] == []
        # loomflow's own writers go through.
        await store.place_hold("alice", reason="litigation", actor="cli:dana")
        await store.release_hold("alice", actor="cli:dana")
        assert [e.action async for e in store.entries(user_id="alice")] == [
            "legal_hold.placed",
            "legal_hold.released",
        ]
        assert (await store.verify()).ok

    # -- queries ----------------------------------------------------------------------------

    async def test_queries_filter_by_user_session_run_action_and_time(
        self, store: AuditStore
    ) -> None:
        await store.append(
            [
                rec("alice", "tool.call", session="s1", run="r1"),
                rec("alice", "tool.result", session="s1", run="r1"),
                rec("alice", "model.call", session="s2", run="r2"),
                rec("bob", "tool.call", session="s1", run="r3"),
                rec("bob", "toolbox.open", session="s3", run="r4"),
            ]
        )

        async def actions(**filters: Any) -> list[tuple[str | None, str]]:
            page = await store.query(**filters)
            return [(e.user_id, e.action) for e in page.entries]

        assert await actions(user_id="alice", action="tool.*") == [
            ("alice", "tool.call"),
            ("alice", "tool.result"),
        ]
        assert await actions(session_id="s1", action="tool.call") == [
            ("alice", "tool.call"),
            ("bob", "tool.call"),
        ]
        assert await actions(run_id="r2") == [("alice", "model.call")]
        assert await actions(user_id="carol") == []
        everything = (await store.query()).entries
        assert len(everything) == 5
        first, last = everything[0].time, everything[-1].time
        assert await actions(since=last + dt.timedelta(seconds=1)) == []
        assert len(await actions(until=last + dt.timedelta(seconds=1))) == 5
        assert len(await actions(since=first.timestamp() - 1)) == 5
        assert await actions(until=first - dt.timedelta(seconds=1)) == []

    async def test_pages_cover_everything_once(self, store: AuditStore) -> None:
        await store.append([rec("alice", i=i) for i in range(7)])
        await store.append([rec("bob", i=i) for i in range(3)])
        seen: list[int] = []
        cursor = None
        pages = 0
        while True:
            page = await store.query(user_id="alice", limit=3, cursor=cursor)
            seen += [(e.payload or {})["i"] for e in page.entries]
            pages += 1
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert seen == list(range(7))
        assert pages == 3
        with pytest.raises(UserError, match="cursor"):
            await store.query(cursor="not-a-cursor")
        with pytest.raises(UserError, match="limit"):
            await store.query(limit=0)

    async def test_an_entry_is_looked_up_by_user_and_seq(self, store: AuditStore) -> None:
        written = await store.append([rec("alice", i=i) for i in range(3)])
        await store.append([rec("bob"), rec(None)])
        assert await store.entry("alice", 2) == written[1]
        assert (await store.entry(None, 1)) is not None
        assert await store.entry("bob", 2) is None
        assert await store.entry("carol", 1) is None
        assert await store.entry("alice", 2**63) is None  # no entry, and no database error
        with pytest.raises(UserError, match="seq"):
            await store.entry("alice", 0)

    async def test_export_writes_the_exported_form_as_json_lines(self, store: AuditStore) -> None:
        written = await store.append([rec("alice", i=1), rec("bob"), rec("alice", i=2)])
        out = io.StringIO()
        assert await store.export(out, user_id="alice") == 2
        header, *lines = out.getvalue().splitlines()
        # A filtered export says what it was made with; a verifier holds its lines to that.
        assert json.loads(header) == {"filters": {"user_id": "alice"}, "loomflow_audit_export": 1}
        assert lines == [written[0].to_line(), written[2].to_line()]
        parsed = json.loads(lines[0])
        assert parsed["user_id"] == "alice"
        assert parsed["time"].endswith("Z")
        assert AuditEntry.from_json(parsed) == written[0]

    async def test_count_matches_what_the_query_pages_return(self, store: AuditStore) -> None:
        # More entries than one page (1000), so counting that pages is tested across pages.
        await store.append([rec("alice", "tool.call", i=i) for i in range(1200)])
        await store.append(
            [
                rec("alice", "model.call", session="s2", run="r2"),
                rec("bob", "tool.call", session="s1", run="r3"),
                rec("bob", "toolbox.open", session="s3", run="r4"),
                rec(None, "tool.result", session="s3", run="r5"),
            ]
        )
        last = (await store.query(run_id="r5")).entries[0].time
        cases: list[dict[str, Any]] = [
            {},
            {"user_id": "alice"},
            {"user_id": None},
            {"user_id": "carol"},
            {"action": "tool.*"},
            {"session_id": "s1", "action": "tool.call"},
            {"run_id": "r4"},
            {"user_id": "bob", "since": last - dt.timedelta(hours=1)},
            {"since": last},
            {"until": last},
        ]
        for filters in cases:
            assert await store.count(**filters) == len(
                [e async for e in store.entries(**filters)]
            ), filters
        assert await store.count() == 1204
        assert await store.count(action="tool.*", user_id="alice") == 1200

    async def test_export_and_verify_report_progress(self, store: AuditStore) -> None:
        await store.append([rec("alice", i=i) for i in range(1500)])
        await store.append([rec("bob", i=i) for i in range(10)])
        exported: list[tuple[int, int | None]] = []
        out = io.StringIO()
        assert await store.export(out, user_id="alice", on_progress=_collect(exported)) == 1500
        assert len(out.getvalue().splitlines()) == 1 + 1500  # the header, then the entries
        assert exported == [(0, 1500), (1000, 1500), (1500, 1500)]  # after every page
        checked: list[tuple[int, int | None]] = []
        report = await store.verify(on_progress=_collect(checked))
        assert report.ok
        assert checked == [(0, 1510), (1000, 1510), (1510, 1510)]  # every 1000, then the end
        one: list[tuple[int, int | None]] = []
        assert (await store.verify(user_id="bob", on_progress=_collect(one))).ok
        assert one == [(0, 10), (10, 10)]
        nothing: list[tuple[int, int | None]] = []
        assert (
            await store.export(io.StringIO(), user_id="carol", on_progress=_collect(nothing)) == 0
        )
        assert nothing == [(0, 0)]

    # -- verification -----------------------------------------------------------------------

    async def _trail(self, store: AuditStore) -> list[AuditEntry]:
        await store.append([rec("bob", i=0)])
        return await store.append([rec("alice", i=i) for i in range(1, 7)])

    async def test_an_intact_trail_verifies(self, store: AuditStore) -> None:
        await self._trail(store)
        report = await store.verify()
        assert report.ok
        assert (report.users, report.entries) == (2, 7)
        assert {(h.user_id, h.seq) for h in report.heads} == {("alice", 6), ("bob", 1)}

    async def test_verify_finds_an_edited_payload(
        self, store: AuditStore, tamper: AuditTamper
    ) -> None:
        await self._trail(store)
        await tamper.edit_payload("alice", 3, {"i": 300})
        report = await store.verify()
        assert [(p.user_id, p.kind, p.seq) for p in report.problems] == [("alice", "edited", 3)]
        assert report.problems[0].position is not None
        assert (await store.verify(user_id="bob")).ok

    async def test_verify_finds_an_entry_rewritten_with_a_fresh_hash(
        self, store: AuditStore, tamper: AuditTamper
    ) -> None:
        trail = await self._trail(store)
        forged = trail[2].model_copy(update={"payload": {"i": 300}})
        await tamper.replace(forged.rehashed())
        report = await store.verify()
        assert [(p.kind, p.seq) for p in report.problems] == [("broken_link", 3)]

    async def test_verify_finds_a_deleted_middle_entry(
        self, store: AuditStore, tamper: AuditTamper
    ) -> None:
        await self._trail(store)
        await tamper.delete("alice", 4)
        report = await store.verify()
        assert [(p.user_id, p.kind, p.seq) for p in report.problems] == [("alice", "missing", 4)]
        assert "4" in report.problems[0].detail

    async def test_verify_finds_a_truncated_tail(
        self, store: AuditStore, tamper: AuditTamper
    ) -> None:
        await self._trail(store)
        await tamper.delete("alice", 6)
        await tamper.delete("alice", 5)
        report = await store.verify()
        assert [(p.kind, p.seq) for p in report.problems] == [("truncated", 5)]
        assert "5-6" in report.problems[0].detail

    async def test_verify_finds_a_reordering(self, store: AuditStore, tamper: AuditTamper) -> None:
        await self._trail(store)
        await tamper.swap("alice", 2, 5)
        report = await store.verify()
        kinds = {(p.kind, p.seq) for p in report.problems}
        assert ("reordered", 3) in kinds or ("reordered", 5) in kinds
        assert {p.kind for p in report.problems} == {"reordered"}, report.problems
        assert all(p.user_id == "alice" for p in report.problems)

    async def test_verify_of_one_user_ignores_damage_elsewhere(
        self, store: AuditStore, tamper: AuditTamper
    ) -> None:
        await self._trail(store)
        await tamper.delete("alice", 2)
        assert (await store.verify(user_id="bob")).ok
        assert not (await store.verify(user_id="alice")).ok
