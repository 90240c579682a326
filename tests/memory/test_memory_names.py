"""Memory names (fact subjects and predicates, block names) and episode ids with a lone
surrogate: refused by name on every backend, as an id with one is, never made U+FFFD."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loomflow.errors import InvalidIdError
from loomflow.memory import InMemoryMemory, Memory, PostgresMemory, SqliteMemory
from loomflow.memory._types import Episode


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def memory(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Memory]:
    if request.param == "memory":
        made: Memory = InMemoryMemory()
    elif request.param == "sqlite":
        made = SqliteMemory(tmp_path / "m.db")
    else:
        made = PostgresMemory(request.getfixturevalue("pg_dsn"))
    yield made
    await made.close()


async def test_a_name_with_a_lone_surrogate_is_refused_not_merged_with_another(
    memory: Memory,
) -> None:
    # Both "\udce9" and "\udcff" became U+FFFD: a fact or block written under one name
    # overwrote the one of another name, and a lookup by either read back the other's value.
    await memory.remember("caf\ufffd", "owner", "mine", user_id="u")
    await memory.set_block("notes\ufffd", "mine", user_id="u")
    refused = [
        ("subject", memory.remember("caf\udce9", "owner", "theirs", user_id="u")),
        ("predicate", memory.remember("caf\ufffd", "own\udcff", "theirs", user_id="u")),
        ("subject", memory.facts(user_id="u", subject="caf\udcff")),
        ("predicate", memory.facts(user_id="u", predicate="owner\ud800")),
        ("subject", memory.retract("caf\udce9", "owner", user_id="u")),
        ("name", memory.set_block("notes\udce9", "theirs", user_id="u")),
        ("name", memory.block("notes\udcff", user_id="u")),
        ("name", memory.delete_block("notes\udce9", user_id="u")),
    ]
    for field, call in refused:
        with pytest.raises(InvalidIdError, match="lone surrogate") as caught:
            await call
        assert caught.value.field == field
    [fact] = await memory.facts(user_id="u", history=True)
    assert (fact.subject, fact.object) == ("caf\ufffd", "mine")
    [block] = await memory.blocks(user_id="u")
    assert (block.name, block.content) == ("notes\ufffd", "mine")


async def test_a_store_refuses_a_lone_surrogate_itself_alike_on_every_backend(
    memory: Memory,
) -> None:
    # Called on the store directly, the in-memory store kept such a name, SQLite raised a
    # bare UnicodeEncodeError and PostgreSQL a StoreUnavailableError (an outage to retry);
    # a name that is no string was an AttributeError or a driver error.
    store = memory.store
    await store.open()
    episode = Episode(
        id="01J0000000000000000000000A",
        session_id="chat\udce9",
        user_id="u",
        key="k",
        run_id=None,
        epoch=0,
        messages=[],
        output="o",
        created_at=dt.datetime.now(dt.UTC),
    )
    refused = [
        ("session_id", store.put_episode(episode)),
        ("id", store.put_episode(episode.model_copy(update={"id": "e\udce9"}))),
        ("key", store.put_episode(episode.model_copy(update={"session_id": "s", "key": "\udc80"}))),
        ("session_id", store.episodes("chat\udce9", "u", before_epoch=None, limit=None)),
        ("session_id", store.delete_episodes("chat\udce9", "u")),
        ("user_id", store.blocks("u\udce9")),
        ("user_id", store.forget_user("u\udce9")),
        ("subject", store.remember("01J0000000000000000000000B", "u", "a\udce9", "p", "o", None)),
        ("predicate", store.retract("u", "a", "p\udce9")),
        ("subject", store.facts("u", subject="a\udce9", predicate=None, as_of=None, history=True)),
        ("name", store.set_block("u", "n\udce9", "c")),
        ("name", store.get_block("u", "n\udce9")),
        ("name", store.delete_block("u", "n\udce9")),
        ("name", store.get_block("u", 7)),  # type: ignore[arg-type]
    ]
    for field, call in refused:
        with pytest.raises(InvalidIdError, match=r"lone surrogate|must be a string") as caught:
            await call
        assert caught.value.field == field
    exported = await memory.export_user("u")
    assert [exported[kind] for kind in ("episodes", "facts", "blocks")] == [[], [], []]
