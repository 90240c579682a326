"""What a crafted journal or checkpoint row can make the decoder do: nothing but build data.

Rows are tampered with directly in the database (a real SQLite file, a real PostgreSQL
database, the in-memory store's dicts), the way an attacker with write access to the journal
would, and then read back by an ordinary resume.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import json
import pickle
import re
import sqlite3
import subprocess
import sys
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, model_validator

from loomflow.agent import Agent, Tuning
from loomflow.errors import CheckpointError, CorruptEntryError, JournalEncodeError
from loomflow.messages import Message, ModelResponse, ToolCall, Usage
from loomflow.runtime import (
    InMemoryRuntime,
    JournalRuntime,
    PickledEntryWarning,
    PostgresRuntime,
    SqliteRuntime,
    _journal,
    codec,
)
from loomflow.testing.checkpoint_conformance import Shop
from loomflow.tools import ToolOutcome

# -- instrumented classes: every construction is recorded ----------------------------------

UNREGISTERED_BUILT: list[str] = []
REGISTERED_BUILT: list[str] = []


def _record(cls: type) -> None:
    (REGISTERED_BUILT if codec.is_registered(cls) else UNREGISTERED_BUILT).append(cls.__name__)


class _RecordingEnumMeta(enum.EnumMeta):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        _record(cls)  # an enum lookup by value goes through here
        return super().__call__(*args, **kwargs)


@dataclasses.dataclass
class TrapDataclass:
    x: Any = None
    label: Any = None

    def __post_init__(self) -> None:
        _record(type(self))


class TrapModel(BaseModel):
    x: Any = None
    label: Any = None

    @model_validator(mode="before")
    @classmethod
    def _seen(cls, data: Any) -> Any:
        _record(cls)
        return data


class TrapEnum(enum.Enum, metaclass=_RecordingEnumMeta):
    A = "a"
    B = 1


@codec.register_type
@dataclasses.dataclass
class AllowedDataclass:
    x: Any = None
    label: Any = None

    def __post_init__(self) -> None:
        _record(type(self))


@codec.register_type
class AllowedModel(BaseModel):
    x: Any = None
    label: Any = None

    @model_validator(mode="before")
    @classmethod
    def _seen(cls, data: Any) -> Any:
        _record(cls)
        return data


@codec.register_type
class AllowedEnum(enum.Enum, metaclass=_RecordingEnumMeta):
    A = "a"
    B = 1


@dataclasses.dataclass
class WritesFile:
    """What an attacker would name: a class whose construction has a side effect."""

    path: str

    def __post_init__(self) -> None:
        Path(self.path).write_text("constructed")


def name_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def nested_lists(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


# -- a journal whose rows the test can rewrite ---------------------------------------------


class Backend:
    """Runtimes over one journal, plus direct write access to its stored rows."""

    def __init__(self, kind: str, tmp_path: Path, dsn: str) -> None:
        self.kind = kind
        self.path = tmp_path / "journal.db"
        self.dsn = dsn
        self.memory = InMemoryRuntime()
        self.opened: list[JournalRuntime] = []

    async def runtime(self, **options: Any) -> JournalRuntime:
        runtime: JournalRuntime
        if self.kind == "memory":
            runtime = JournalRuntime(self.memory._store, **options)
        elif self.kind == "sqlite":
            runtime = SqliteRuntime(self.path, **options)
        else:
            runtime = await PostgresRuntime.connect(self.dsn, **options)
        self.opened.append(runtime)
        return runtime

    async def tamper_entry(self, name: str, raw: bytes, fmt: str = "json") -> None:
        """Overwrite the stored value of every journal entry of step ``name``."""
        if self.kind == "memory":
            store = self.memory._store
            changed = 0
            for runs in store.entries.values():
                for run in runs.values():
                    for key, (entry, created) in list(run.items()):
                        if entry.name == name:
                            run[key] = (dataclasses.replace(entry, value=raw, format=fmt), created)
                            changed += 1
            assert changed == 1
            return
        await self._sql(
            "UPDATE loom_entries SET value = $1, format = $2 WHERE name = $3", raw, fmt, name
        )

    async def tamper_idempotent(self, key: str, raw: bytes, fmt: str) -> None:
        if self.kind == "memory":
            store = self.memory._store
            (found,) = [k for k in store.idempotent if k[1] == key]
            entry, created = store.idempotent[found]
            store.idempotent[found] = (dataclasses.replace(entry, value=raw, format=fmt), created)
            return
        await self._sql(
            "UPDATE loom_idempotency SET value = $1, format = $2 WHERE idem_key = $3", raw, fmt, key
        )

    async def idempotent_format(self, key: str) -> str:
        if self.kind == "memory":
            (found,) = [v for k, v in self.memory._store.idempotent.items() if k[1] == key]
            return found[0].format
        rows = await self._sql("SELECT format FROM loom_idempotency WHERE idem_key = $1", key)
        return str(rows[0][0])

    async def _sql(self, sql: str, *args: Any, one: bool = True) -> list[Any]:
        """Run ``sql`` (``$n`` placeholders) on the journal's database; ``one``: one row changes."""
        if self.kind == "sqlite":

            def run() -> list[Any]:
                conn = sqlite3.connect(self.path)
                try:
                    with conn:
                        cursor = conn.execute(re.sub(r"\$(\d)", r"?\1", sql), args)
                        rows = cursor.fetchall()
                        if one and sql.startswith("UPDATE"):
                            assert cursor.rowcount == 1
                        return rows
                finally:
                    conn.close()

            return await asyncio.to_thread(run)
        import asyncpg

        conn = await asyncpg.connect(self.dsn)
        try:
            if sql.startswith("UPDATE"):
                status = await conn.execute(sql, *args)
                assert status == "UPDATE 1" or not one, status
                return []
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    dsn = request.getfixturevalue("pg_dsn") if request.param == "postgres" else ""
    journal = Backend(request.param, tmp_path, dsn)
    yield journal
    for runtime in journal.opened:
        await runtime.close()


class Body:
    """A step body that counts its executions (its side effect)."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, *args: Any) -> dict[str, Any]:
        self.calls += 1
        return {"fresh": self.calls}


async def leave_open(runtime: JournalRuntime, name: str, body: Body) -> None:
    """Journal step ``name`` in a run that then fails, so the run stays open to resume."""
    with pytest.raises(RuntimeError, match="crash"):
        async with runtime.session("s", "u"):
            await runtime.step(name, body)
            raise RuntimeError("crash")


# -- item 1: only registered classes are rebuilt ---------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
async def test_a_row_naming_an_unregistered_dataclass_runs_none_of_its_code(
    backend: Backend, tmp_path: Path, strict: bool
) -> None:
    runtime = await backend.runtime()
    body = Body()
    await leave_open(runtime, "a", body)
    target = tmp_path / "pwned.txt"
    row = {"$t": "dataclass", "v": {"cls": name_of(WritesFile), "fields": {"path": str(target)}}}
    await backend.tamper_entry("a", json.dumps(row).encode())

    modules = set(sys.modules)
    async with runtime.session("s", "u", strict_replay=strict) as run:
        value = await runtime.step("a", body)
    assert value == {"path": str(target)}  # plain data, never a WritesFile
    assert not target.exists()
    assert set(sys.modules) == modules
    assert (run.stats.hits, run.stats.corrupt, body.calls) == (1, 0, 1)
    WritesFile(str(target))  # the trap is real: constructing it does write the file
    assert target.exists()


def test_a_row_naming_a_lazily_loaded_loomflow_class_imports_nothing(tmp_path: Path) -> None:
    # A fresh interpreter: the test process may have imported the module already.
    script = """
import json, sys
import loomflow, loomflow.audit
from loomflow.runtime import codec
before = "loomflow.audit.postgres" in sys.modules
row = {"$t": "model", "v": {"cls": "loomflow.audit:PostgresAuditStore", "fields": {"dsn": "x"}}}
value = codec.loads(json.dumps(row))
print(json.dumps([before, "loomflow.audit.postgres" in sys.modules, value]))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout) == [False, False, {"dsn": "x"}]


async def test_registered_types_and_loomflow_value_types_are_rebuilt(backend: Backend) -> None:
    runtime = await backend.runtime()
    values: list[Any] = [
        AllowedDataclass(1, "x"),
        AllowedModel(x=[1], label="y"),
        AllowedEnum.B,
        Message.user("hi"),
        ModelResponse(
            text="ok",
            tool_calls=[ToolCall(id="c", name="t", arguments={"a": 1})],
            usage=Usage(input_tokens=3, output_tokens=4),
        ),
        ToolOutcome(ok=True, value={"temp": 21}),
    ]
    body = Body()

    async def produce() -> list[Any]:
        body.calls += 1
        return values

    with pytest.raises(RuntimeError, match="crash"):
        async with runtime.session("s", "u"):
            await runtime.step("a", produce)
            raise RuntimeError("crash")
    async with runtime.session("s", "u", strict_replay=True) as run:
        replayed = await runtime.step("a", produce)
    assert run.stats.hits == 1
    assert body.calls == 1
    assert replayed == values
    assert [type(v) for v in replayed] == [type(v) for v in values]


def test_registration_is_checked_and_by_identity() -> None:
    with pytest.raises(TypeError):
        codec.register_type(int)
    with pytest.raises(TypeError):
        codec.register_type("os:system")  # type: ignore[arg-type]
    assert codec.is_registered(AllowedModel)
    assert codec.is_registered(Message)
    assert not codec.is_registered(TrapModel)


# The class names a crafted row may try: the test's traps, registered classes, classes of the
# standard library and loomflow that must never be looked up, and noise.
CLASS_NAMES = st.one_of(
    st.sampled_from(
        [
            name_of(TrapDataclass),
            name_of(TrapModel),
            name_of(TrapEnum),
            name_of(AllowedDataclass),
            name_of(AllowedModel),
            name_of(AllowedEnum),
            name_of(Message),
            name_of(ToolOutcome),
            "os:system",
            "subprocess:Popen",
            "builtins:eval",
            "pathlib:Path",
            "antigravity:Thing",
            "this:s",
            "loomflow.audit:PostgresAuditStore",
            "loomflow.runtime:PostgresRuntime",
            "collections:OrderedDict",
        ]
    ),
    st.text(max_size=20),
    st.integers(),
)
FIELD_NAMES = st.one_of(
    st.sampled_from(["x", "label", "role", "content", "ok", "value"]), st.text(max_size=4)
)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=10),
    st.sampled_from(["a", "nan", "inf", "2024-01-02", "12:00", "1.5", "AAEC", "user", "$t"]),
)


def _tagged_trees(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    tags = st.one_of(st.sampled_from(sorted(codec._DECODERS)), st.text(max_size=6), st.integers())
    return st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=4), inner, max_size=4),
        st.builds(lambda t, v: {"$t": t, "v": v}, tags, inner),
        st.builds(
            lambda t, c, f: {"$t": t, "v": {"cls": c, "fields": f}},
            st.sampled_from(["model", "dataclass"]),
            CLASS_NAMES,
            st.one_of(st.dictionaries(FIELD_NAMES, inner, max_size=3), inner),
        ),
        st.builds(lambda c, v: {"$t": "enum", "v": {"cls": c, "value": v}}, CLASS_NAMES, inner),
        st.builds(
            lambda pairs: {"$t": "dict", "v": pairs},
            st.lists(st.lists(inner, max_size=3), max_size=3),
        ),
    )


ROWS = st.one_of(
    st.recursive(LEAVES, _tagged_trees, max_leaves=25).map(lambda tree: json.dumps(tree).encode()),
    st.binary(max_size=40),
    st.integers(0, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(0, 400).map(lambda n: ('{"$t":"tuple","v":[' * n + "]}" * n).encode()),
    st.integers(0, 400).map(
        lambda n: ('{"$t":"enum","v":{"cls":"x:Y","value":' * n + "1" + "}}" * n).encode()
    ),
)


def _only_data(value: Any) -> None:
    """Everything in a decoded value is JSON data, a codec value type or a registered class."""
    import datetime as dt
    import decimal
    import uuid

    if isinstance(value, list | tuple | set | frozenset):
        for item in value:
            _only_data(item)
    elif isinstance(value, dict):
        for k, v in value.items():
            _only_data(k)
            _only_data(v)
    elif isinstance(value, BaseModel | enum.Enum) or dataclasses.is_dataclass(value):
        assert codec.is_registered(type(value)), type(value)
    else:
        plain = (str, int, float, bytes, dt.date, dt.time, dt.timedelta, decimal.Decimal, uuid.UUID)
        assert value is None or isinstance(value, plain), type(value)


def test_fuzzed_rows_import_nothing_and_build_only_registered_types() -> None:
    counts: collections.Counter[str] = collections.Counter()
    built_before = (len(UNREGISTERED_BUILT), len(REGISTERED_BUILT))

    @settings(
        max_examples=3000,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(ROWS)
    def decode_one(raw: bytes) -> None:
        counts["examples"] += 1
        modules = set(sys.modules)
        unregistered = len(UNREGISTERED_BUILT)
        try:
            value = codec.loads(raw)
        except codec.UnknownTagError:  # the one documented failure: a corrupt entry
            counts["refused"] += 1
        else:
            counts["decoded"] += 1
            _only_data(value)
        imported = set(sys.modules) - modules
        assert not imported, (raw[:200], imported)
        counts["imports"] += len(imported)
        counts["unregistered constructions"] += len(UNREGISTERED_BUILT) - unregistered

    decode_one()
    counts["registered constructions"] = len(REGISTERED_BUILT) - built_before[1]
    print(f"\ndecoder fuzz: {dict(counts)}")
    assert counts["examples"] >= 3000
    assert counts["imports"] == 0
    assert counts["unregistered constructions"] == 0
    assert len(UNREGISTERED_BUILT) == built_before[0]
    # The fuzz did reach the construction paths: registered classes were built.
    assert counts["registered constructions"] > 0
    assert counts["decoded"] > 0
    assert counts["refused"] > 0


# -- item 2: depth and cycles ------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 200_000 + b"]" * 200_000,  # past the parser's own recursion
        json.dumps(nested_lists(codec.MAX_DEPTH + 1)).encode(),  # parses, but over the limit
    ],
    ids=["200000-deep", "limit+1"],
)
async def test_a_row_nested_too_deep_is_corrupt(backend: Backend, raw: bytes) -> None:
    runtime = await backend.runtime()
    body = Body()
    await leave_open(runtime, "a", body)
    await backend.tamper_entry("a", raw)
    with pytest.raises(CorruptEntryError, match=r"'a'.*nested"):
        async with runtime.session("s", "u", strict_replay=True):
            await runtime.step("a", body)
    assert body.calls == 1
    with pytest.raises(RuntimeError, match="crash"):
        async with runtime.session("s", "u") as run:
            assert await runtime.step("a", body) == {"fresh": 2}
            raise RuntimeError("crash")
    assert run.stats.corrupt == 1
    async with runtime.session("s", "u") as run:  # the fresh result replaced the bad row
        assert await runtime.step("a", body) == {"fresh": 2}
    assert run.stats.hits == 1
    assert body.calls == 2


async def test_values_up_to_the_limit_are_stored_and_deeper_ones_refused_at_write(
    backend: Backend,
) -> None:
    runtime = await backend.runtime()
    deepest = nested_lists(codec.MAX_DEPTH)
    too_deep = nested_lists(codec.MAX_DEPTH + 1)

    async def give(value: Any) -> Any:
        return value

    with pytest.raises(RuntimeError, match="crash"):
        async with runtime.session("s", "u"):
            assert await runtime.step("ok", lambda: deepest) == deepest
            with pytest.raises(JournalEncodeError, match=r"'deep': its result .*nested more"):
                await runtime.step("deep", lambda: too_deep)
            with pytest.raises(JournalEncodeError, match=r"'args': its arguments .*nested"):
                await runtime.step("args", give, too_deep)
            raise RuntimeError("crash")
    assert [e.name for e in await runtime.entries("s", "u")] == ["ok"]  # nothing unreadable
    async with runtime.session("s", "u", strict_replay=True) as run:
        assert await runtime.step("ok", lambda: None) == deepest
    assert run.stats.hits == 1


def _cyclic_list() -> Any:
    value: list[Any] = [1]
    value.append(value)
    return value


def _cyclic_dict() -> Any:
    value: dict[str, Any] = {}
    value["self"] = {"again": value}
    return value


def _cyclic_dataclass() -> Any:
    value = AllowedDataclass()
    value.x = [value]
    return value


@pytest.mark.parametrize("make", [_cyclic_list, _cyclic_dict, _cyclic_dataclass])
async def test_a_cyclic_result_is_a_journal_encode_error(make: Any) -> None:
    runtime = InMemoryRuntime()
    async with runtime.session("s", "u"):
        with pytest.raises(
            JournalEncodeError, match=r"'loop': its result .*contains itself"
        ) as info:
            await runtime.step("loop", make)
    assert info.value.step == "loop"


def test_the_codec_itself_refuses_depth_and_cycles() -> None:
    with pytest.raises(codec.NestingTooDeepError):
        codec.dumps(_cyclic_list())
    with pytest.raises(codec.UnknownTagError, match="nested"):
        codec.loads(json.dumps(nested_lists(codec.MAX_DEPTH + 1)))
    deep_tuple = '{"$t":"tuple","v":[' * (codec.MAX_DEPTH + 1) + "]}" * (codec.MAX_DEPTH + 1)
    with pytest.raises(codec.UnknownTagError, match="nested"):
        codec.loads(deep_tuple)
    assert codec.loads(codec.dumps(nested_lists(codec.MAX_DEPTH))) == nested_lists(codec.MAX_DEPTH)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_deeply_nested_checkpoint_falls_back_to_journal_replay(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    journal = Backend(
        kind, tmp_path, request.getfixturevalue("pg_dsn") if kind == "postgres" else ""
    )
    try:
        runtime = await journal.runtime()
        shop = Shop(fail_at=2)
        agent = Agent(
            "You shop.",
            model=shop.model,
            tools=[shop.tool],
            runtime=runtime,
            tuning=Tuning(checkpoint=True),
        )
        with pytest.raises(ConnectionError):
            await agent.run("shop", session_id="s", user_id="u")
        bomb = b"[" * 200_000 + b"]" * 200_000
        await journal._sql("UPDATE loom_checkpoints SET messages = $1", bomb, one=False)
        strict = Agent(
            "You shop.",
            model=shop.model,
            tools=[shop.tool],
            runtime=runtime,
            tuning=Tuning(checkpoint=True, strict_replay=True),
        )
        with pytest.raises(CheckpointError, match="cannot be decoded"):
            await strict.resume("shop", session_id="s", user_id="u")
        result = await agent.resume("shop", session_id="s", user_id="u")
        assert result.restored_from is None
        assert result.replayed_steps == 4  # two model calls and two tool calls, from the journal
        assert shop.bought == ["apples", "bread", "cheese"]
    finally:
        for runtime in journal.opened:
            await runtime.close()


# -- item 12: an unreadable row under an idempotency key ---------------------------------------


@pytest.mark.parametrize(
    ("fmt", "raw"), [("pickle", pickle.dumps({"legacy": True})), ("json", b"{oops")]
)
async def test_an_unreadable_idempotency_row_is_replaced_once(
    backend: Backend, fmt: str, raw: bytes
) -> None:
    runtime = await backend.runtime()
    charge = Body()
    async with runtime.session("s", "u"):
        assert await runtime.step("charge", charge, idempotency_key="order-1") == {"fresh": 1}
    await backend.tamper_idempotent("order-1", raw, fmt)

    _journal._pickle_warned = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with runtime.session("s", "u") as run:
            assert await runtime.step("charge", charge, idempotency_key="order-1") == {"fresh": 2}
    assert charge.calls == 2  # the unreadable row cost one fresh run, no more
    assert run.stats.corrupt == (1 if fmt == "json" else 0)
    pickled = [w for w in caught if issubclass(w.category, PickledEntryWarning)]
    assert len(pickled) == (1 if fmt == "pickle" else 0)
    assert await backend.idempotent_format("order-1") == "json"
    for _ in range(2):  # retries, in new runs: replayed, the side effect is not repeated
        async with runtime.session("s", "u") as run:
            assert await runtime.step("charge", charge, idempotency_key="order-1") == {"fresh": 2}
        assert run.stats.hits == 1
    assert charge.calls == 2


async def test_replacing_an_unreadable_idempotency_row_keeps_a_concurrent_winner(
    backend: Backend,
) -> None:
    from loomflow.runtime._store import StoredEntry

    runtime = await backend.runtime()
    async with runtime.session("s", "u"):
        await runtime.step("charge", Body(), idempotency_key="k")
    await backend.tamper_idempotent("k", b"{oops", "json")
    store = runtime._store
    async with runtime.session("s", "u") as run:
        unreadable = await store.get_idempotent(run.scope.user_key, "k")
        assert unreadable is not None
        assert unreadable.value == b"{oops"
        first = StoredEntry("[]", "charge", "", "step", "json", 1, codec.dumps("first"))
        second = StoredEntry("[]", "charge", "", "step", "json", 1, codec.dumps("second"))
        # A writer fenced out by a newer owner replaces nothing and learns it lost its turn.
        fenced = await store.put_idempotent(
            run.scope, run.token - 1, "k", first, replacing=unreadable
        )
        assert fenced is None
        assert await store.get_idempotent(run.scope.user_key, "k") == unreadable
        assert (
            await store.put_idempotent(run.scope, run.token, "k", first, replacing=unreadable)
            == first
        )
        # A second writer that read the same unreadable row finds the first one's result.
        winner = await store.put_idempotent(run.scope, run.token, "k", second, replacing=unreadable)
        assert winner is not None
        assert winner.value == first.value


async def test_a_tool_value_too_deep_to_journal_is_a_tool_error_not_a_failed_run() -> None:
    from loomflow.tools import tool

    @tool
    def nest(depth: int) -> Any:
        """Return lists nested ``depth`` deep.

        Args:
            depth: How deep.
        """
        return nested_lists(depth)

    # The journaled outcome wraps the value: one level fewer fits.
    fits = await nest.invoke({"depth": codec.MAX_DEPTH - 1})
    assert fits.ok
    assert codec.loads(codec.dumps(fits)) == fits
    too_deep = await nest.invoke({"depth": codec.MAX_DEPTH})
    assert not too_deep.ok
    assert too_deep.error_type == "tool_error"
