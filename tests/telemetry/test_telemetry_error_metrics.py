"""Provider errors and retries, tool errors and run duration as metrics (issue 16, item 6).

Real SDKs against the local fake provider servers: the 429 is a real HTTP answer, retried by
our retry loop, and counted through the run's metrics.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from loomflow.agent import Agent
from loomflow.errors import ModelError, ModelRetryExhaustedError
from loomflow.messages import ToolCall
from loomflow.models import AnthropicModel, Backoff, FunctionModel, OpenAIModel
from loomflow.models._arguments import parse_tool_arguments
from loomflow.runtime import SqliteRuntime
from loomflow.telemetry import ERROR_CLASSES, RUN_BUCKETS, RUN_OUTCOMES, Metrics, Telemetry
from loomflow.telemetry._metrics import error_class
from loomflow.testing.providers import Failure, FakeAnthropicAPI, FakeOpenAIAPI, Reply
from loomflow.tools import tool

FAST = Backoff(initial=0.001, maximum=0.005)
MODEL = {"provider": "anthropic", "model": "claude-opus-4-7"}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


@tool
def lookup(order: int) -> str:
    """Look an order up."""
    raise RuntimeError(f"order {order}: warehouse offline")


async def test_a_retried_429_a_failed_tool_and_the_run_duration_are_counted(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    script = (
        Failure(429, headers={"retry-after": "0"}),
        Reply(tool_calls=[ToolCall(id="t1", name="lookup", arguments={"order": 7})]),
        Reply(text="The warehouse is offline."),
    )
    runtime = SqliteRuntime(tmp_path / "journal.db")
    with FakeAnthropicAPI(*script) as api:
        model = AnthropicModel(
            "claude-opus-4-7", base_url=api.base_url, api_key="test", backoff=FAST
        )
        agent = Agent(
            "x",
            model=model,
            tools=[lookup],
            runtime=runtime,
            telemetry=Telemetry(metrics=Metrics(registry), tracing=False),
        )
        try:
            result = await agent.run("where?", session_id="s", user_id="u")
        finally:
            await model.aclose()
            await runtime.close()
        assert api.request_count == 3  # the 429, then two answered calls
    assert result.output == "The warehouse is offline."
    assert value(registry, "loomflow_model_retries_total", **MODEL, error="rate_limit") == 1
    # Every error class of the model exists from the run's start, the failures at 0.
    for error in ERROR_CLASSES:
        assert (
            registry.get_sample_value("loomflow_model_errors_total", {**MODEL, "error": error})
            == 0.0
        )
    assert (
        value(registry, "loomflow_tool_errors_total", tool="lookup", error_type="tool_error") == 1
    )
    assert value(registry, "loomflow_run_duration_seconds_count", outcome="finished") == 1
    assert value(registry, "loomflow_run_duration_seconds_sum", outcome="finished") > 0
    for outcome in ("interrupted", "failed", "cancelled"):  # created at 0 for rate()
        assert (
            registry.get_sample_value("loomflow_run_duration_seconds_count", {"outcome": outcome})
            == 0.0
        )


async def test_exhausted_retries_count_each_retry_and_one_error(
    registry: CollectorRegistry,
) -> None:
    with FakeOpenAIAPI(*[Failure(503)] * 3) as api:
        model = OpenAIModel(
            "gpt-4.1", base_url=api.base_url, api_key="test", backoff=FAST, max_retries=2
        )
        agent = Agent(
            "x", model=model, telemetry=Telemetry(metrics=Metrics(registry), tracing=False)
        )
        try:
            with pytest.raises(ModelRetryExhaustedError):
                await agent.run("hi", session_id="s")
        finally:
            await model.aclose()
    labels = {"provider": "openai", "model": "gpt-4.1"}
    assert value(registry, "loomflow_model_retries_total", **labels, error="server") == 2
    assert value(registry, "loomflow_model_errors_total", **labels, error="server") == 1
    assert value(registry, "loomflow_model_errors_total", **labels, error="rate_limit") == 0
    assert value(registry, "loomflow_run_duration_seconds_count", outcome="failed") == 1


async def test_a_client_error_is_not_retried_and_counts_as_client(
    registry: CollectorRegistry,
) -> None:
    with FakeAnthropicAPI(Failure(400, message="bad request")) as api:
        model = AnthropicModel(
            "claude-opus-4-7", base_url=api.base_url, api_key="test", backoff=FAST
        )
        agent = Agent(
            "x", model=model, telemetry=Telemetry(metrics=Metrics(registry), tracing=False)
        )
        try:
            with pytest.raises(ModelError):
                await agent.run("hi", session_id="s")
        finally:
            await model.aclose()
    assert value(registry, "loomflow_model_errors_total", **MODEL, error="client") == 1
    assert (
        sum(
            value(registry, "loomflow_model_retries_total", **MODEL, error=e) for e in ERROR_CLASSES
        )
        == 0
    )


async def test_retries_of_one_run_go_to_that_runs_registry_only() -> None:
    # Two agents on two registries run at once; each registry sees only its own retries.
    mine, other = CollectorRegistry(), CollectorRegistry()
    with (
        FakeAnthropicAPI(Failure(529), Failure(529), Reply(text="a")) as first,
        FakeAnthropicAPI(Reply(text="b")) as second,
    ):
        m1 = AnthropicModel("claude-opus-4-7", base_url=first.base_url, api_key="k", backoff=FAST)
        m2 = AnthropicModel("claude-opus-4-7", base_url=second.base_url, api_key="k", backoff=FAST)
        a1 = Agent("x", model=m1, telemetry=Telemetry(metrics=Metrics(mine), tracing=False))
        a2 = Agent("y", model=m2, telemetry=Telemetry(metrics=Metrics(other), tracing=False))
        try:
            await asyncio.gather(a1.run("hi", session_id="1"), a2.run("hi", session_id="2"))
        finally:
            await m1.aclose()
            await m2.aclose()
    assert value(mine, "loomflow_model_retries_total", **MODEL, error="server") == 2
    assert value(other, "loomflow_model_retries_total", **MODEL, error="server") == 0


async def test_a_tool_name_the_model_made_up_is_counted_as_unknown(
    registry: CollectorRegistry,
) -> None:
    def decide(messages: list[object], tools: list[object]) -> object:
        if len(messages) < 3:
            return [ToolCall(id="c1", name="user-4711-secret-tool", arguments={})]
        return "done"

    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[lookup],
        telemetry=Telemetry(metrics=Metrics(registry), tracing=False),
    )
    await agent.run("hi", session_id="s")
    assert (
        value(registry, "loomflow_tool_errors_total", tool="unknown", error_type="unknown_tool")
        == 1
    )
    assert "user-4711" not in str([s for f in registry.collect() for s in f.samples])


async def test_a_model_error_from_a_plain_exception_is_other(registry: CollectorRegistry) -> None:
    def decide(messages: list[object], tools: list[object]) -> object:
        raise RuntimeError("boom")

    agent = Agent(
        "x",
        model=FunctionModel(decide),
        telemetry=Telemetry(metrics=Metrics(registry), tracing=False),
    )
    with pytest.raises(RuntimeError):
        await agent.run("hi", session_id="s")
    assert agent.model.provider
    labels = {"provider": agent.model.provider, "model": agent.model.name}
    assert value(registry, "loomflow_model_errors_total", **labels, error="other") == 1


def _bad_arguments() -> BaseException:
    try:
        parse_tool_arguments("[1, 2]", provider="p", model="m", tool="t", call_id="c")
    except ModelError as exc:
        return exc
    raise AssertionError("[1, 2] was taken for arguments")


@pytest.mark.parametrize(
    ("status", "exc", "expected"),
    [
        (429, None, "rate_limit"),
        (408, None, "timeout"),
        (500, None, "server"),
        (529, None, "server"),
        (404, None, "client"),
        (None, TimeoutError(), "timeout"),
        (None, ConnectionResetError(), "connection"),
        (None, ModelError("p", "m", "stream dropped"), "connection"),
        # Arguments that are not a JSON object: the answer was bad, not the connection.
        (None, _bad_arguments(), "other"),
        (None, ValueError("x"), "other"),
    ],
)
def test_error_classes_come_from_a_fixed_set(
    status: int | None, exc: BaseException | None, expected: str
) -> None:
    assert error_class(status, exc) == expected
    assert expected in ERROR_CLASSES


def test_run_outcomes_and_buckets_are_fixed() -> None:
    assert len(RUN_BUCKETS) + 1 <= 18  # the label test's bound on `le` values
    assert set(RUN_OUTCOMES) == {"finished", "interrupted", "failed", "cancelled", "claim_lost"}
