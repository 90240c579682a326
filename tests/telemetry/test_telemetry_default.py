"""Telemetry is on by default (global tracer provider, default Prometheus registry); opt-out and
the user-id option on spans."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from loomflow.agent import Agent
from loomflow.errors import ConfigurationError
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.runtime import InMemoryRuntime
from loomflow.telemetry import Metrics, Telemetry, default_telemetry
from loomflow.telemetry.testing import SpanCapture
from loomflow.tools import tool

# The application: installs an SDK provider as the global one *after* building the agent (the
# proxy tracer must still deliver), with no telemetry= argument; runs, then resumes.
APP = """
import asyncio, json
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY
from loomflow.agent import Agent
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime
from loomflow.tools import tool

@tool
def lookup(order: int) -> str:
    \"\"\"Look an order up.\"\"\"
    return "shipped"

async def main():
    runtime = SqliteRuntime("journal.db")
    model = ScriptedModel([[ToolCall(id="c1", name="lookup", arguments={"order": 7})], "Shipped."])
    agent = Agent("x", model=model, tools=[lookup], runtime=runtime)
    second = Agent("y", model=model, tools=[lookup], runtime=runtime)  # same default metrics
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    await agent.run("where?", session_id="s-1", user_id="ana")
    await agent.resume("where?", session_id="s-1", user_id="ana")
    await runtime.close()
    steps = [
        dict(s.attributes) for s in exporter.get_finished_spans() if s.name == "loom.workflow.step"
    ]
    samples = [
        {"name": s.name, "labels": s.labels, "value": s.value}
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name == "loomflow_journal_steps_total"
    ]
    print(json.dumps({"steps": steps, "samples": samples}))

asyncio.run(main())
"""


def run_app(tmp_path: Path, **env: str) -> dict[str, list[dict[str, object]]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LOOMFLOW_", "OTEL_"))}
    clean.update(env)
    done = subprocess.run(
        [sys.executable, "-c", APP],
        env=clean,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, list[dict[str, object]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_an_agent_without_telemetry_traces_to_the_global_provider_and_counts_on_the_registry(
    tmp_path: Path,
) -> None:
    found = run_app(tmp_path)
    steps = found["steps"]
    # The run: model call, tool call, model call, memory episode (misses); the resume replays
    # the four (hits).
    assert len(steps) == 8
    assert [s["loom.step.replay"] for s in steps] == ["miss"] * 4 + ["hit"] * 4
    assert all(s["user_id"] == "ana" and s["user.id"] == "ana" for s in steps)
    assert all(s["session.id"] == "s-1" for s in steps)

    counts = {
        (str(s["labels"]["kind"]), str(s["labels"]["outcome"])): s["value"]  # type: ignore[index]
        for s in found["samples"]
        if s["labels"]["backend"] == "sqlite"  # type: ignore[index]
    }
    assert counts[("model", "miss")] == 2
    assert counts[("tool", "miss")] == 1
    assert counts[("model", "hit")] == 2
    assert counts[("tool", "hit")] == 1
    assert counts[("memory", "miss")] == counts[("memory", "hit")] == 1
    # Bounded labels only: never a user, a session or a run.
    for sample in found["samples"]:
        labels = sample["labels"]
        assert isinstance(labels, dict)
        assert set(labels) == {"backend", "kind", "outcome"}
        assert not {"ana", "s-1"} & set(labels.values())


def test_hashed_user_ids_from_the_environment_reach_the_default_telemetry(tmp_path: Path) -> None:
    key = "deployment-secret-0123456789"
    found = run_app(
        tmp_path,
        LOOMFLOW_TELEMETRY_USER_IDS="hashed",
        LOOMFLOW_TELEMETRY_USER_ID_KEY=key,
    )
    expected = "h:" + hmac.new(key.encode(), b"ana", hashlib.sha256).hexdigest()[:16]
    assert found["steps"]
    assert {s["user_id"] for s in found["steps"]} == {expected}
    assert {s["user.id"] for s in found["steps"]} == {expected}


@tool
def lookup(order: int) -> str:
    """Look an order up."""
    return "shipped"


def script() -> ScriptedModel:
    return ScriptedModel([[ToolCall(id="c1", name="lookup", arguments={"order": 7})], "Shipped."])


def default_registry_steps() -> float:
    return sum(
        s.value
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name == "loomflow_journal_steps_total"
    )


async def test_telemetry_false_records_nothing() -> None:
    before = default_registry_steps()
    capture = SpanCapture()
    registry = CollectorRegistry()
    runtime = InMemoryRuntime()
    # A private telemetry would trace this runtime if the opted-out agent had instrumented it.
    agent = Agent("x", model=script(), tools=[lookup], runtime=runtime, telemetry=False)
    assert agent.telemetry is None
    assert agent.clone().telemetry is None  # the opt-out survives clone()
    await agent.run("where?", session_id="s", user_id="ana")
    await agent.resume("where?", session_id="s", user_id="ana")
    assert default_registry_steps() == before
    watched = Agent(
        "x",
        model=script(),
        tools=[lookup],
        runtime=runtime,
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=Metrics(registry)),
    )
    await watched.run("where?", session_id="s2", user_id="bob")
    # Only the instrumented agent's run shows up: 4 steps (model, tool, model, memory), bob's.
    steps = capture.named("loom.workflow.step")
    assert len(steps) == 4
    assert {s.attributes["user_id"] for s in steps} == {"bob"}
    total = sum(
        registry.get_sample_value(
            "loomflow_journal_steps_total",
            {"backend": "memory", "kind": kind, "outcome": outcome},
        )
        or 0.0
        for kind in ("model", "tool", "memory")
        for outcome in ("hit", "miss")
    )
    assert total == 4


def test_agents_without_telemetry_share_one_default() -> None:
    first = Agent("x", model=script())
    second = Agent("y", model=script())
    assert first.telemetry is second.telemetry is default_telemetry()
    assert first.clone().telemetry is default_telemetry()
    # Building the default metrics again on the default registry is harmless.
    assert Metrics()._c is Metrics()._c


@pytest.mark.parametrize("mode", ["plain", "hashed", "omit"])
async def test_user_id_option_on_run_and_step_spans(mode: str) -> None:
    capture = SpanCapture()
    key = "k" * 32
    telemetry = Telemetry(
        tracer_provider=capture.provider,
        metrics=False,
        user_ids=mode,  # type: ignore[arg-type]
        user_id_key=key,
    )
    agent = Agent(
        "x", model=script(), tools=[lookup], runtime=InMemoryRuntime(), telemetry=telemetry
    )
    await agent.run("where?", session_id="s", user_id="ana")
    spans = [*capture.named("loom.workflow.step"), *capture.named("invoke_agent agent")]
    assert len(spans) == 5
    for span in spans:
        attributes = dict(span.attributes or {})
        if mode == "omit":
            assert "user_id" not in attributes
            assert "user.id" not in attributes
            assert "ana" not in json.dumps(attributes)
        elif mode == "plain":
            assert attributes["user_id"] == attributes["user.id"] == "ana"
        else:
            digest = hmac.new(key.encode(), b"ana", hashlib.sha256).hexdigest()[:16]
            assert attributes["user_id"] == attributes["user.id"] == f"h:{digest}"
        assert attributes["session.id"] == "s"  # sessions are untouched by the option


def test_hashed_user_ids_need_a_real_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOOMFLOW_TELEMETRY_USER_ID_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="LOOMFLOW_TELEMETRY_USER_ID_KEY"):
        Telemetry(metrics=False, user_ids="hashed", user_id_key=None, settings=None)
    with pytest.raises(ConfigurationError, match="16 characters"):
        Telemetry(metrics=False, user_ids="hashed", user_id_key="short")
    with pytest.raises(ConfigurationError, match="plain, hashed, omit"):
        Telemetry(metrics=False, user_ids="masked")  # type: ignore[arg-type]


# Runs once with no SDK installed (counting the spans the proxy tracer is asked for), then
# installs one and runs again.
APP_LATE_SDK = """
import asyncio, json
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from loomflow.agent import Agent
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime
from loomflow.tools import tool

asked = []
start_span = trace.ProxyTracer.start_span
def counting(self, name, *args, **kwargs):
    asked.append(name)
    return start_span(self, name, *args, **kwargs)
trace.ProxyTracer.start_span = counting

@tool
async def lookup(order: int) -> str:
    \"\"\"Look an order up.\"\"\"
    return "shipped"

def script():
    return ScriptedModel([[ToolCall(id="c1", name="lookup", arguments={"order": 7})], "Shipped."])

async def main():
    runtime = SqliteRuntime("journal.db")
    await Agent("x", model=script(), tools=[lookup], runtime=runtime).run(
        "where?", session_id="s-1", user_id="ana"
    )
    before = list(asked)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    await Agent("x", model=script(), tools=[lookup], runtime=runtime).run(
        "where?", session_id="s-2", user_id="ana"
    )
    await runtime.close()
    names = sorted({s.name.split(" ")[0] for s in exporter.get_finished_spans()})
    print(json.dumps({"before": before, "after": names}))

asyncio.run(main())
"""


def test_no_spans_are_built_before_an_sdk_is_installed_and_all_after(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LOOMFLOW_", "OTEL_"))}
    done = subprocess.run(
        [sys.executable, "-c", APP_LATE_SDK],
        env=clean,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    # Every span would have been a no-op: the proxy tracer was not even asked for one.
    assert found["before"] == []
    assert found["after"] == ["chat", "execute_tool", "invoke_agent", "loom.workflow.step"]
