"""Tool.invoke: validation, failures, timeouts and the run context in threads and tasks."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from loomflow import RunContext, get_run_context
from loomflow.audit import AuditRecord, JsonlAuditStore
from loomflow.context import use_run_context
from loomflow.errors import UserError
from loomflow.runtime import codec
from loomflow.tools import ToolOutcome, tool
from loomflow.tools._tool import tool_threads_running


class Quote(BaseModel):
    sku: str
    cents: int


@tool
def add(a: int, b: int = 10) -> int:
    """Add two numbers."""
    return a + b


@tool
async def quote(sku: str, qty: int = 1) -> Quote:
    """Price a SKU."""
    await asyncio.sleep(0)
    return Quote(sku=sku, cents=250 * qty)


# --- direct calls --------------------------------------------------------------------------


async def test_tools_stay_callable_like_the_function() -> None:
    assert add(1, 2) == 3
    assert await quote("A") == Quote(sku="A", cents=250)
    assert add.__name__ == "add"
    assert add.__doc__ == "Add two numbers."


# --- success -------------------------------------------------------------------------------


async def test_sync_and_async_success() -> None:
    assert await add.invoke({"a": 1}) == ToolOutcome(ok=True, value=11)
    outcome = await quote.invoke({"sku": "B", "qty": 2})
    assert outcome.ok
    assert outcome.value == Quote(sku="B", cents=500)
    assert outcome.as_text() == '{"sku":"B","cents":500}'


async def test_string_numbers_are_coerced() -> None:
    # Models sometimes send "3" for 3; pydantic's lax mode accepts it, as it does for JSON.
    assert (await add.invoke({"a": "3", "b": "4"})).value == 7


async def test_unsupplied_defaults_are_the_functions_own() -> None:
    sentinel: list[int] = []

    @tool
    def f(items: list[int] = sentinel) -> bool:
        return items is sentinel

    assert (await f.invoke({})).value is True
    assert (await f.invoke({"items": []})).value is False


async def test_positional_only_parameters() -> None:
    @tool
    def f(a: int, b: int = 2, /, *, c: int = 3) -> list[int]:
        return [a, b, c]

    assert (await f.invoke({"a": 1, "c": 5})).value == [1, 2, 5]


async def test_none_arguments_for_a_tool_without_parameters() -> None:
    @tool
    def ping() -> str:
        return "pong"

    assert (await ping.invoke(None)).as_text() == "pong"


async def test_sync_callable_returning_a_coroutine_is_awaited() -> None:
    async def inner() -> str:
        return "awaited"

    def wrapper() -> Any:
        return inner()

    assert (await tool(wrapper).invoke({})).value == "awaited"


# --- invalid arguments ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "fragments"),
    [
        ({}, ["missing required argument 'a'"]),
        ({"a": "many"}, ["argument 'a'", "valid integer", "'many'"]),
        ({"a": 1, "c": 2}, ["unexpected argument 'c'", "accepted arguments: a, b"]),
        ({"b": [1]}, ["missing required argument 'a'", "argument 'b'"]),
    ],
)
async def test_invalid_arguments_are_outcomes(
    arguments: dict[str, Any], fragments: list[str]
) -> None:
    outcome = await add.invoke(arguments)
    assert not outcome.ok
    assert outcome.error_type == "invalid_arguments"
    assert outcome.error is not None
    assert outcome.error.startswith("invalid arguments for tool 'add': ")
    for fragment in fragments:
        assert fragment in outcome.error
    assert outcome.as_text().startswith("Error: invalid arguments")


async def test_nested_model_errors_name_the_path() -> None:
    @tool
    def order(items: list[Quote]) -> None:
        """Order."""

    outcome = await order.invoke({"items": [{"sku": "A", "cents": 1}, {"sku": "B"}]})
    assert outcome.error_type == "invalid_arguments"
    assert "argument 'items[1].cents': Field required" in (outcome.error or "")


async def test_non_object_arguments() -> None:
    outcome = await add.invoke([1, 2])  # type: ignore[arg-type]
    assert outcome.error_type == "invalid_arguments"
    assert "must be a JSON object, got list" in (outcome.error or "")


async def test_model_cannot_supply_the_context_parameter() -> None:
    @tool
    def whoami(ctx: RunContext) -> str | None:
        return ctx.user_id

    outcome = await whoami.invoke({"ctx": {"user_id": "mallory"}})
    assert outcome.error_type == "invalid_arguments"
    assert "unexpected argument 'ctx'" in (outcome.error or "")


async def test_tool_does_not_run_on_invalid_arguments() -> None:
    calls: list[int] = []

    @tool
    def record(n: int) -> None:
        calls.append(n)

    await record.invoke({"n": "x"})
    assert calls == []


# --- failures ------------------------------------------------------------------------------


async def test_exceptions_become_tool_errors() -> None:
    @tool
    def sync_fail(city: str) -> str:
        raise ValueError(f"unknown city {city}")

    @tool
    async def async_fail() -> str:
        raise KeyError("k")

    @tool
    def bare_fail() -> None:
        raise RuntimeError

    outcome = await sync_fail.invoke({"city": "Atlantis"})
    assert outcome == ToolOutcome(
        ok=False, error_type="tool_error", error="ValueError: unknown city Atlantis"
    )
    assert outcome.as_text() == "Error: ValueError: unknown city Atlantis"
    assert (await async_fail.invoke({})).error == "KeyError: 'k'"
    assert (await bare_fail.invoke({})).error == "RuntimeError"


async def test_unstorable_return_value_is_a_tool_error() -> None:
    @tool
    def leak() -> object:
        return threading.Lock()

    outcome = await leak.invoke({})
    assert outcome.error_type == "tool_error"
    assert "lock" in (outcome.error or "")
    assert "JSON-like" in (outcome.error or "")


@pytest.mark.parametrize("levels", [150, 5000])
async def test_a_result_nested_too_deep_says_so(levels: int) -> None:
    # A dict is JSON-like: the model must read that it nests too deep, not that dicts are
    # refused, or it can only ask for the same thing again.
    @tool
    def tree() -> dict[str, Any]:
        value: dict[str, Any] = {}
        for _ in range(levels):
            value = {"child": value}
        return value

    outcome = await tree.invoke({})
    assert outcome.error_type == "tool_error"
    assert "nested more than 100 containers deep" in (outcome.error or "")


async def test_cancelling_the_caller_propagates() -> None:
    started = asyncio.Event()

    @tool
    async def hang() -> None:
        started.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(hang.invoke({}))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# --- timeouts ------------------------------------------------------------------------------


async def test_async_timeout_cancels_the_tool() -> None:
    cancelled = asyncio.Event()

    @tool(timeout=0.05)
    async def slow() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    start = time.monotonic()
    outcome = await slow.invoke({})
    assert time.monotonic() - start < 5
    assert outcome.error_type == "timeout"
    assert outcome.error == "tool 'slow' did not finish within 0.05 s"
    assert cancelled.is_set()


async def test_sync_timeout_returns_while_the_thread_lingers() -> None:
    release = threading.Event()
    finished = threading.Event()

    @tool(timeout=0.05)
    def slow() -> str:
        release.wait(10)
        finished.set()
        return "late"

    try:
        outcome = await slow.invoke({})
        assert outcome.error_type == "timeout"
        assert not finished.is_set()  # the thread is still blocked: it cannot be killed
    finally:
        release.set()
    await asyncio.to_thread(finished.wait, 5)
    assert finished.is_set()


async def test_sync_tools_left_hanging_do_not_starve_the_loops_own_threads(
    tmp_path: Path,
) -> None:
    # Sync tools ran in the event loop's default executor (6 threads on two cores): a few
    # stuck past their timeout left none for the loop's DNS lookups and the JSONL audit
    # store, and every run of the process stalled behind them.
    release = threading.Event()

    # A timeout long enough for every call to reach its thread on a loaded machine (a call
    # still queued when it times out never starts); the count is at least `many`, as threads of
    # other tests may still be winding down.
    @tool(timeout=1.0)
    def stuck() -> str:
        release.wait(30)
        return "late"

    # More than the default executor holds on any machine (cpu_count + 4, at most 32).
    many = min(32, (os.cpu_count() or 1) + 4) + 6
    try:
        outcomes = await asyncio.gather(*(stuck.invoke({}) for _ in range(many)))
        assert {o.error_type for o in outcomes} == {"timeout"}
        assert tool_threads_running() >= many
        store = JsonlAuditStore(tmp_path / "audit.jsonl")
        async with asyncio.timeout(10):
            await asyncio.get_running_loop().getaddrinfo("127.0.0.1", 5432)
            [entry] = await store.append([AuditRecord(user_id="u", actor="a", action="x")])
        assert entry.user_id == "u"
        # And the sync tools that come after still run.
        assert (await add.invoke({"a": 1})).value == 11
    finally:
        release.set()


async def test_fast_tool_within_timeout_and_own_timeout_error() -> None:
    @tool(timeout=5)
    async def quick() -> int:
        return 1

    @tool(timeout=5)
    def flaky_http() -> None:
        raise TimeoutError("upstream read timed out")

    assert (await quick.invoke({})).value == 1
    # A TimeoutError raised by the tool itself is its failure, not our deadline.
    outcome = await flaky_http.invoke({})
    assert outcome.error_type == "tool_error"
    assert outcome.error == "TimeoutError: upstream read timed out"


# --- run context ---------------------------------------------------------------------------


@tool
def sync_probe(tag: str) -> dict[str, Any]:
    """Report the context seen from a worker thread."""
    time.sleep(0.01)  # long enough for parallel calls to overlap
    ctx = get_run_context()
    return {
        "tag": tag,
        "user": ctx.user_id,
        "run": ctx.run_id,
        "thread": threading.get_ident(),
    }


@tool
async def async_probe(tag: str, ctx: RunContext) -> dict[str, Any]:
    """Report the context seen by an async tool, injected and ambient."""
    await asyncio.sleep(0.01)
    ambient = get_run_context()
    assert ambient is ctx
    return {"tag": tag, "user": ctx.user_id, "run": ctx.run_id}


def _ctx(user: str) -> RunContext:
    return RunContext(run_id=f"run-{user}", session_id="s", user_id=user, metadata={"k": 1})


async def test_sync_tools_run_in_a_thread_and_see_the_context() -> None:
    with use_run_context(_ctx("alice")):
        outcome = await sync_probe.invoke({"tag": "t"})
    assert outcome.value["user"] == "alice"
    assert outcome.value["run"] == "run-alice"
    assert outcome.value["thread"] != threading.get_ident()


async def test_a_non_blocking_sync_tool_runs_on_the_event_loop() -> None:
    @tool(blocking=False)
    def here(tag: str) -> dict[str, Any]:
        return {"tag": tag, "user": get_run_context().user_id, "thread": threading.get_ident()}

    assert here.blocking is False
    assert sync_probe.blocking is True
    assert async_probe.blocking is False  # async tools never take a thread
    with use_run_context(_ctx("alice")):
        outcome = await here.invoke({"tag": "t"})
    assert outcome.value == {"tag": "t", "user": "alice", "thread": threading.get_ident()}


def test_blocking_is_refused_where_it_cannot_mean_anything() -> None:
    async def coro() -> int:
        return 1

    def quick() -> int:
        return 1

    with pytest.raises(UserError, match="blocking= applies to sync functions"):
        tool(blocking=True)(coro)
    with pytest.raises(UserError, match="a timeout needs blocking=True"):
        tool(blocking=False, timeout=1)(quick)


async def test_context_is_injected_into_sync_and_async_tools() -> None:
    @tool
    def sync_who(ctx: RunContext) -> dict[str, Any]:
        return {"user": ctx.user_id, "meta": dict(ctx.metadata)}

    with use_run_context(_ctx("bob")):
        assert (await sync_who.invoke({})).value == {"user": "bob", "meta": {"k": 1}}
        assert (await async_probe.invoke({"tag": "x"})).value["user"] == "bob"


async def test_outside_a_run_the_injected_context_is_empty() -> None:
    @tool
    def who(ctx: RunContext | None) -> str | None:
        assert ctx is not None
        return ctx.user_id

    assert (await who.invoke({})).ok
    assert (await who.invoke({})).value is None


async def test_parallel_calls_each_see_their_own_run() -> None:
    async def call_as(user: str) -> list[ToolOutcome]:
        with use_run_context(_ctx(user)):
            return list(
                await asyncio.gather(
                    sync_probe.invoke({"tag": user}), async_probe.invoke({"tag": user})
                )
            )

    users = [f"user{i}" for i in range(6)]
    results = await asyncio.gather(*(call_as(u) for u in users))
    for user, outcomes in zip(users, results, strict=True):
        for outcome in outcomes:
            assert outcome.ok, outcome
            assert outcome.value["tag"] == user
            assert outcome.value["user"] == user
            assert outcome.value["run"] == f"run-{user}"


async def test_parallel_sync_tools_really_overlap() -> None:
    # Each call waits at the barrier until all four are inside their threads at once; run
    # one after another they would hit the barrier timeout instead.
    barrier = threading.Barrier(4, timeout=5)

    @tool
    def meet(i: int) -> str | None:
        barrier.wait()
        return get_run_context().user_id

    with use_run_context(_ctx("carol")):
        outcomes = await asyncio.gather(*(meet.invoke({"i": i}) for i in range(4)))
    assert [o.value for o in outcomes] == ["carol"] * 4


# --- the outcome model ---------------------------------------------------------------------


def test_outcome_text_rendering() -> None:
    assert ToolOutcome(ok=True, value="plain text").as_text() == "plain text"
    assert ToolOutcome(ok=True, value={"a": [1, 2], "b": None}).as_text() == '{"a":[1,2],"b":null}'
    assert ToolOutcome(ok=True).as_text() == "null"
    assert ToolOutcome(ok=True, value=[Quote(sku="Z", cents=1)]).as_text() == (
        '[{"sku":"Z","cents":1}]'
    )
    assert ToolOutcome(ok=False, error_type="timeout").as_text() == "Error: timeout"
    assert ToolOutcome(ok=True, value={"x": math.inf}).as_text() == '{"x":"Infinity"}'
    assert ToolOutcome(ok=True, value=b"\xff\x00").as_text() == '"_wA="'  # URL-safe alphabet
    assert ToolOutcome(ok=True, value=("a", 1)).as_text() == '["a",1]'


def test_outcome_is_frozen_and_journal_encodable() -> None:
    outcome = ToolOutcome(ok=True, value=Quote(sku="Q", cents=3))
    with pytest.raises(ValueError, match="frozen"):
        outcome.ok = False
    encoded = codec.encode(outcome)
    assert encoded["v"]["cls"] == "loomflow.tools:ToolOutcome"
    decoded = codec.loads(codec.dumps(outcome))
    assert type(decoded) is ToolOutcome  # registered by loomflow
    # Quote is not registered, so it comes back as plain data; the model reads the same text.
    assert decoded.value == {"sku": "Q", "cents": 3}
    assert decoded.as_text() == outcome.as_text()


async def test_without_a_timeout_the_tools_own_timeout_error_is_its_failure() -> None:
    # No deadline is armed without a timeout; the tool's TimeoutError is still its failure.
    @tool
    async def flaky_http() -> None:
        raise TimeoutError("upstream read timed out")

    assert flaky_http.timeout is None
    outcome = await flaky_http.invoke({})
    assert outcome.error_type == "tool_error"
    assert outcome.error == "TimeoutError: upstream read timed out"


async def test_a_tool_without_a_timeout_arms_no_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    armed: list[float | None] = []
    real = asyncio.timeout

    def counting(delay: float | None) -> Any:
        armed.append(delay)
        return real(delay)

    monkeypatch.setattr(asyncio, "timeout", counting)
    assert (await add.invoke({"a": 1})).value == 11
    assert armed == []  # asyncio.timeout(None) would be set up and torn down for nothing

    @tool(timeout=5)
    async def quick() -> int:
        return 1

    assert (await quick.invoke({})).value == 1
    assert armed == [5]
