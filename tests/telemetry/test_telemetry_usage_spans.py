"""Usage on a run's root span: live calls under gen_ai.usage.*, replayed ones under
loom.usage.replayed.*, so that a resumed run's span agrees with the metrics and the audit log."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from loomflow.agent import Agent
from loomflow.messages import ModelResponse, ToolCall, Usage
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime
from loomflow.telemetry import Metrics, Telemetry
from loomflow.telemetry.testing import SpanCapture
from loomflow.tools import tool


@tool
def lookup(order: int) -> str:
    """Look an order up."""
    return "shipped"


async def test_a_resumed_run_reports_replayed_usage_apart_from_live_usage(tmp_path: Path) -> None:
    capture = SpanCapture()
    registry = CollectorRegistry()
    telemetry = Telemetry(tracer_provider=capture.provider, metrics=Metrics(registry))
    runtime = SqliteRuntime(tmp_path / "journal.db")
    answer = ModelResponse(
        text="Shipped.",
        usage=Usage(
            input_tokens=400, output_tokens=3, cache_read_tokens=300, cache_write_tokens=50
        ),
    )
    model = ScriptedModel([[ToolCall(id="c1", name="lookup", arguments={"order": 7})], answer])
    agent = Agent("support", model=model, tools=[lookup], runtime=runtime, telemetry=telemetry)
    first = await agent.run("where?", session_id="s-usage", user_id="ana")
    capture_first = {s.name: s for s in capture.spans if s.name.startswith("invoke_agent")}
    capture.clear()
    again = await agent.resume("where?", session_id="s-usage", user_id="ana")
    await runtime.close()
    assert again.tokens_in == first.tokens_in  # the result still totals the whole run

    [live_root] = capture_first.values()
    assert live_root.attributes["gen_ai.usage.input_tokens"] == first.tokens_in
    assert live_root.attributes["gen_ai.usage.output_tokens"] == first.tokens_out
    assert live_root.attributes["gen_ai.usage.cache_read.input_tokens"] == 300
    assert live_root.attributes["gen_ai.usage.cache_creation.input_tokens"] == 50
    assert live_root.attributes["loom.usage.replayed.input_tokens"] == 0
    assert live_root.attributes["loom.usage.replayed.output_tokens"] == 0

    [resumed_root] = [s for s in capture.spans if s.name.startswith("invoke_agent")]
    assert resumed_root.attributes["loom.run.resumed"] is True
    # Nothing was called (or billed) by the resume...
    assert resumed_root.attributes["gen_ai.usage.input_tokens"] == 0
    assert resumed_root.attributes["gen_ai.usage.output_tokens"] == 0
    assert "gen_ai.usage.cache_read.input_tokens" not in resumed_root.attributes
    # ...and what it replayed is reported under loomflow's own names.
    assert resumed_root.attributes["loom.usage.replayed.input_tokens"] == first.tokens_in
    assert resumed_root.attributes["loom.usage.replayed.output_tokens"] == first.tokens_out
    assert resumed_root.attributes["loom.usage.replayed.cache_read.input_tokens"] == 300
    assert resumed_root.attributes["loom.usage.replayed.cache_creation.input_tokens"] == 50
    # The metrics agree with the live figures: the resume added no tokens.
    tokens = registry.get_sample_value(
        "loomflow_model_tokens_total",
        {"provider": "scripted", "model": model.name, "type": "input"},
    )
    assert tokens == first.tokens_in


async def test_a_failed_run_reports_the_usage_of_the_calls_it_made() -> None:
    # Usage went on the root span only with a result: a run that failed after a billed call
    # showed no tokens in its trace, while the metrics and the audit log counted them.
    from loomflow.errors import ModelError
    from loomflow.models import OpenAIModel
    from loomflow.testing.providers import Failure, FakeOpenAIAPI, Reply

    capture = SpanCapture()
    registry = CollectorRegistry()
    telemetry = Telemetry(tracer_provider=capture.provider, metrics=Metrics(registry))
    call = ToolCall(id="c1", name="lookup", arguments={"order": 7})
    replies = [Reply(tool_calls=[call], input_tokens=100, output_tokens=10), Failure(400)]
    with FakeOpenAIAPI(*replies) as api:
        model = OpenAIModel("gpt-4o", base_url=api.base_url, api_key="test")
        agent = Agent("support", model=model, tools=[lookup], telemetry=telemetry, memory=False)
        with pytest.raises(ModelError):
            await agent.run("where?", session_id="s-failed", user_id="ana")
        await model.aclose()

    [root] = [s for s in capture.spans if s.name.startswith("invoke_agent")]
    assert root.attributes["loom.run.outcome"] == "failed"
    assert root.attributes["gen_ai.usage.input_tokens"] == 100
    assert root.attributes["gen_ai.usage.output_tokens"] == 10
    assert root.attributes["loom.usage.replayed.input_tokens"] == 0
    tokens = registry.get_sample_value(
        "loomflow_model_tokens_total", {"provider": "openai", "model": "gpt-4o", "type": "input"}
    )
    assert tokens == 100


async def test_a_call_whose_usage_went_unreported_records_no_token_figures() -> None:
    # A server that sends no usage: the call was recorded as 0 input and 0 output tokens, a
    # point of the GenAI token histogram and a chat span saying the call used nothing.
    from loomflow.models import OpenAIModel
    from loomflow.telemetry.testing import MetricCapture
    from loomflow.testing.providers import FakeOpenAIAPI, Reply

    capture, metrics = SpanCapture(), MetricCapture()
    telemetry = Telemetry(tracer_provider=capture.provider, meter_provider=metrics.provider)
    with FakeOpenAIAPI(Reply(text="hi", report_usage=False), Reply(text="hi")) as api:
        model = OpenAIModel("gpt-4o", base_url=api.base_url, api_key="test")
        agent = Agent("support", model=model, telemetry=telemetry, memory=False)
        await agent.run("where?", user_id="ana")
        await agent.run("where?", user_id="ana")
        await model.aclose()

    unreported, reported = capture.named("chat gpt-4o")
    assert "gen_ai.usage.input_tokens" not in unreported.attributes
    assert "gen_ai.usage.output_tokens" not in unreported.attributes
    assert reported.attributes["gen_ai.usage.input_tokens"] == 12
    # One call's figures, not two: the unreported call left no zeros in the histogram.
    assert metrics.count("gen_ai.client.token.usage", **{"gen_ai.token.type": "input"}) == 1
    assert metrics.count("gen_ai.client.operation.duration") == 2
