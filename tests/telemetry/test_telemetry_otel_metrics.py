"""OpenTelemetry metrics, read through the SDK's InMemoryMetricReader: the GenAI client metrics
and loomflow's own, recorded from the same calls as the Prometheus series, with bounded
attributes and never a user, session or run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from loomflow.agent import Agent
from loomflow.errors import ModelError
from loomflow.messages import ModelResponse, ToolCall, Usage
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime
from loomflow.telemetry import OTEL_INSTRUMENTS, Metrics, Telemetry
from loomflow.telemetry.testing import MetricCapture, SpanCapture
from loomflow.tools import tool

FORBIDDEN_KEYS = {"user.id", "user_id", "session.id", "gen_ai.conversation.id", "loom.run.id"}


@tool
def lookup(order: int) -> str:
    """Look an order up."""
    return "shipped"


def points(metric: Any, **attributes: str) -> list[Any]:
    return [
        p
        for p in metric.data.data_points
        if all(p.attributes.get(k) == v for k, v in attributes.items())
    ]


def total(metric: Any, **attributes: str) -> float:
    """The sum of a counter's points, or of a histogram's sums, that match ``attributes``."""
    return float(
        sum(getattr(p, "value", None) or getattr(p, "sum", 0) for p in points(metric, **attributes))
    )


def count(metric: Any, **attributes: str) -> int:
    return sum(p.count for p in points(metric, **attributes))


@pytest.fixture
def reader() -> MetricCapture:
    return MetricCapture()


async def test_a_run_and_its_resume_as_genai_and_loomflow_metrics(
    tmp_path: Path, reader: MetricCapture, registry: CollectorRegistry
) -> None:
    capture = SpanCapture()
    metrics = Metrics(registry, meter_provider=reader.provider)
    telemetry = Telemetry(tracer_provider=capture.provider, metrics=metrics)
    runtime = SqliteRuntime(tmp_path / "journal.db")
    model = ScriptedModel([[ToolCall(id="c1", name="lookup", arguments={"order": 7})], "Shipped."])
    agent = Agent("support", model=model, tools=[lookup], runtime=runtime, telemetry=telemetry)
    first = await agent.run("where is order 7?", session_id="s-otel", user_id="ana-otel")
    again = await agent.resume("where is order 7?", session_id="s-otel", user_id="ana-otel")
    await runtime.close()
    assert again.fresh_steps == 0
    assert model.calls == 2

    found = reader.collect()
    data = reader.reader.get_metrics_data()
    assert data is not None
    assert {s.scope.name for r in data.resource_metrics for s in r.scope_metrics} == {"loomflow"}
    chat = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "scripted",
        "gen_ai.request.model": model.name,
    }
    # GenAI client metrics: the two live calls, never the replayed ones.
    usage = found["gen_ai.client.token.usage"]
    assert usage.unit == "{token}"
    assert total(usage, **chat, **{"gen_ai.token.type": "input"}) == first.tokens_in
    assert total(usage, **chat, **{"gen_ai.token.type": "output"}) == first.tokens_out
    # The capture helper reads the same figures.
    assert reader.total("gen_ai.client.token.usage", **{"gen_ai.token.type": "output"}) == (
        first.tokens_out
    )
    assert reader.count("gen_ai.client.operation.duration") == 2
    assert reader.total("loomflow.journal.steps", outcome="hit") == again.replayed_steps
    assert count(usage, **{"gen_ai.token.type": "input"}) == 2
    assert list(points(usage)[0].explicit_bounds[:3]) == [1.0, 4.0, 16.0]
    duration = found["gen_ai.client.operation.duration"]
    assert duration.unit == "s"
    assert count(duration, **chat) == 2
    assert not any("error.type" in p.attributes for p in points(duration))
    assert 0 < total(duration) < 10
    # Both scripted answers streamed deltas (a tool-call delta, then text deltas).
    first_chunk = found["gen_ai.client.operation.time_to_first_chunk"]
    assert first_chunk.unit == "s"
    assert count(first_chunk, **chat) == 2
    assert total(first_chunk) <= total(duration)

    # Ours, with the Prometheus labels as attributes.
    steps = found["loomflow.journal.steps"]
    assert steps.unit == "{step}"
    assert total(steps, backend="sqlite", kind="model", outcome="miss") == 2
    assert total(steps, backend="sqlite", kind="tool", outcome="miss") == 1
    assert total(steps, backend="sqlite", kind="model", outcome="hit") == 2
    assert total(steps, backend="sqlite", kind="tool", outcome="hit") == 1
    assert total(steps, outcome="miss") == first.fresh_steps
    assert total(steps, outcome="hit") == again.replayed_steps
    step_seconds = found["loomflow.step.duration"]
    assert step_seconds.unit == "s"
    assert count(step_seconds) == first.fresh_steps + again.replayed_steps
    # Only a step that wrote an entry has a write time: the first run's.
    assert count(found["loomflow.journal.write"], backend="sqlite") == first.fresh_steps
    runs = found["loomflow.runs"]
    assert total(runs, backend="sqlite", outcome="finished", resumed="false") == 1
    assert total(runs, backend="sqlite", outcome="finished", resumed="true") == 1
    assert count(found["loomflow.run.duration"], outcome="finished") == 2

    # One place: the Prometheus series hold the same counts.
    for kind in ("model", "tool", "memory", "custom"):
        for outcome in ("hit", "miss"):
            prom = registry.get_sample_value(
                "loomflow_journal_steps_total",
                {"backend": "sqlite", "kind": kind, "outcome": outcome},
            )
            assert prom == total(steps, backend="sqlite", kind=kind, outcome=outcome)
    prom_in = registry.get_sample_value(
        "loomflow_model_tokens_total",
        {"provider": "scripted", "model": model.name, "type": "input"},
    )
    assert prom_in == first.tokens_in
    assert (
        registry.get_sample_value(
            "loomflow_model_call_duration_seconds_count",
            {"provider": "scripted", "model": model.name, "error": "none"},
        )
        == 2
    )

    # Never a user, a session or a run: neither as an attribute key nor as a value.
    ids = {"ana-otel", "s-otel", first.run_id, again.run_id}
    for metric in found.values():
        for point in metric.data.data_points:
            assert not FORBIDDEN_KEYS & set(point.attributes), (metric.name, point.attributes)
            assert not ids & {str(v) for v in point.attributes.values()}, metric.name


async def test_a_failed_call_has_an_error_type_and_a_refused_one_no_duration(
    reader: MetricCapture, registry: CollectorRegistry
) -> None:
    metrics = Metrics(registry, meter_provider=reader.provider)
    model = ScriptedModel([ModelError("scripted", "scripted", "slow down", status=429)])
    agent = Agent("x", model=model, telemetry=Telemetry(metrics=metrics, tracing=False))
    with pytest.raises(ModelError):
        await agent.run("hi", session_id="s-err")
    duration = reader.collect()["gen_ai.client.operation.duration"]
    [point] = points(duration)
    assert point.attributes["error.type"] == "rate_limit"
    assert point.count == 1
    errors = reader.collect()["loomflow.model.errors"]
    assert total(errors, provider="scripted", error="rate_limit") == 1
    assert total(reader.collect()["loomflow.runs"], outcome="failed") == 1


async def test_cache_figures_reach_spans_and_metrics_apart_from_input(
    reader: MetricCapture, registry: CollectorRegistry
) -> None:
    capture = SpanCapture()
    metrics = Metrics(registry, meter_provider=reader.provider)
    cached = ModelResponse(
        text="Hi.",
        usage=Usage(
            input_tokens=1000, output_tokens=5, cache_read_tokens=700, cache_write_tokens=200
        ),
        model="scripted",
    )
    agent = Agent(
        "x",
        model=ScriptedModel([cached]),
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=metrics),
    )
    await agent.run("hi", session_id="s-cache")
    [chat] = [s for s in capture.spans if s.name.startswith("chat")]
    assert chat.attributes["gen_ai.usage.input_tokens"] == 1000
    assert chat.attributes["gen_ai.usage.cache_read.input_tokens"] == 700
    assert chat.attributes["gen_ai.usage.cache_creation.input_tokens"] == 200
    found = reader.collect()
    # The GenAI token histogram counts every input token once (cache included)...
    assert total(found["gen_ai.client.token.usage"], **{"gen_ai.token.type": "input"}) == 1000
    # ...and the cache parts have their own counter, as in Prometheus.
    cache = found["loomflow.model.cache_tokens"]
    assert cache.unit == "{token}"
    assert total(cache, type="read") == 700
    assert total(cache, type="write") == 200
    labels = {"provider": "scripted", "model": "scripted", "type": "read"}
    assert registry.get_sample_value("loomflow_model_cache_tokens_total", labels) == 700


def test_every_instrument_has_a_conventional_unit_and_a_unique_name() -> None:
    names = [spec.name for spec in OTEL_INSTRUMENTS.values()]
    assert len(set(names)) == len(names)
    for spec in OTEL_INSTRUMENTS.values():
        assert spec.unit == "s" or spec.unit.startswith("{"), spec
        assert spec.name.startswith(("gen_ai.client.", "loomflow.")), spec
        assert (spec.kind == "histogram") == (spec.buckets is not None), spec


def _collector_name(spec: Any) -> str:
    """The name an OTel-to-Prometheus translation (the collector's Prometheus exporter, with its
    default unit and type suffixes) gives an instrument: dots become underscores, ``s`` adds
    ``_seconds``, an annotation unit in braces adds nothing, a counter adds ``_total``."""
    name = spec.name.replace(".", "_")
    if spec.unit == "s" and not name.endswith("_seconds"):
        name += "_seconds"
    return name + ("_total" if spec.kind == "counter" else "")


def test_loomflows_own_instruments_arrive_over_otlp_under_their_prometheus_names() -> None:
    # An SRE who pushes metrics over OTLP (the collector of deploy/ re-exposes them) must find
    # the names the alert rules and the dashboard use, not near misses that keep alerts silent.
    registry = CollectorRegistry()
    Metrics(registry=registry, otel=False)
    exposed = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in registry.collect()
    }
    own = {key: spec for key, spec in OTEL_INSTRUMENTS.items() if spec.name.startswith("loomflow.")}
    assert own
    for key, spec in own.items():
        assert _collector_name(spec) in exposed, (key, spec.name, _collector_name(spec))


def test_runs_by_state_is_a_gauge_of_the_latest_report(reader: MetricCapture) -> None:
    metrics = Metrics(CollectorRegistry(), meter_provider=reader.provider)
    metrics.runs_by_state("postgres", {"orphaned": 3, "running": 2})
    metrics.runs_by_state("postgres", {"orphaned": 1})
    gauge = reader.collect()["loomflow.runs.by_state"]
    [point] = points(gauge, backend="postgres", state="orphaned")
    assert point.value == 1
    [emptied] = points(gauge, backend="postgres", state="running")
    assert emptied.value == 0  # a state that empties reads 0, not its last value


def test_recoveries_reach_the_meter_without_run_attributes(reader: MetricCapture) -> None:
    metrics = Metrics(CollectorRegistry(), meter_provider=reader.provider)
    metrics.recovery("resumed")
    metrics.recovery("resumed")
    metrics.recovery_delay(2.5)
    collected = reader.collect()
    [point] = points(collected["loomflow.recoveries"], outcome="resumed")
    assert point.value == 2
    [delay] = points(collected["loomflow.recovery.delay"])
    assert delay.count == 1
    assert delay.sum == 2.5


def test_metrics_without_otel_build_no_instrument(reader: MetricCapture) -> None:
    metrics = Metrics(CollectorRegistry(), meter_provider=reader.provider, otel=False)
    metrics.audit_entry("run.start")
    assert reader.collect() == {}


# The application installs an SDK meter provider as the global one *after* building its
# agents, with no telemetry= argument on one and telemetry=False on the other.
APP = """
import asyncio, json
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from loomflow.agent import Agent
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime

def names(reader):
    data = reader.get_metrics_data()
    if data is None:
        return []
    return sorted(
        m.name for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics
    )

async def main():
    runtime = SqliteRuntime("journal.db")
    quiet = Agent("q", model=ScriptedModel(["ok"]), runtime=runtime, telemetry=False)
    loud = Agent("l", model=ScriptedModel(["ok"]), runtime=runtime)
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    await quiet.run("hi", session_id="s-quiet")
    after_quiet = names(reader)
    await loud.run("hi", session_id="s-loud")
    print(json.dumps({"quiet": after_quiet, "loud": names(reader)}))
    await runtime.close()

asyncio.run(main())
"""


def test_the_default_records_to_the_global_meter_provider_and_opt_out_records_nothing(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOMFLOW_", "OTEL_"))}
    done = subprocess.run(
        [sys.executable, "-c", APP],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["quiet"] == []
    assert {
        "gen_ai.client.token.usage",
        "gen_ai.client.operation.duration",
        "loomflow.journal.steps",
        "loomflow.runs",
    } <= set(out["loud"])


# -- export over OTLP, from the standard variables -------------------------------------------

EXPORTER = """
import asyncio
from loomflow.agent import Agent
from loomflow.models import ScriptedModel
from loomflow.runtime import InMemoryRuntime
from loomflow.telemetry import setup_telemetry

async def main():
    setup = setup_telemetry()
    print("METERS", setup.meter_provider is not None)
    agent = Agent("x", model=ScriptedModel(["hello"]), runtime=InMemoryRuntime())
    await agent.run("hi", session_id="s-export", user_id="bob-export")
    setup.shutdown()  # exports what the periodic reader holds

asyncio.run(main())
"""


def _export(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LOOMFLOW_", "OTEL_"))}
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-c", EXPORTER],
        env=clean,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_otel_metrics_export_over_otlp_when_the_standard_variable_asks(
    otlp_receiver: tuple[str, Any], tmp_path: Path
) -> None:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    url, received = otlp_receiver
    done = _export(
        tmp_path,
        OTEL_EXPORTER_OTLP_ENDPOINT=url,
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_TRACES_EXPORTER="none",
        OTEL_SERVICE_NAME="orders",
    )
    assert done.returncode == 0, done.stderr
    assert "METERS True" in done.stdout
    assert set(received.paths) == {"/v1/metrics"}
    names: set[str] = set()
    for body in received.bodies:
        for resource in ExportMetricsServiceRequest.FromString(body).resource_metrics:
            service = {a.key: a.value.string_value for a in resource.resource.attributes}
            assert service["service.name"] == "orders"
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    names.add(metric.name)
                    kind = metric.WhichOneof("data")
                    for point in getattr(metric, kind).data_points:
                        keys = {a.key for a in point.attributes}
                        values = {a.value.string_value for a in point.attributes}
                        assert not FORBIDDEN_KEYS & keys, metric.name
                        assert not {"bob-export", "s-export"} & values, metric.name
    assert {"gen_ai.client.token.usage", "gen_ai.client.operation.duration"} <= names
    assert {"loomflow.journal.steps", "loomflow.runs", "loomflow.run.duration"} <= names


def test_without_the_metrics_exporter_variable_no_metrics_are_pushed(
    otlp_receiver: tuple[str, Any], tmp_path: Path
) -> None:
    url, received = otlp_receiver
    done = _export(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=url)
    assert done.returncode == 0, done.stderr
    assert "METERS False" in done.stdout
    assert "/v1/metrics" not in received.paths


def test_an_unknown_metrics_exporter_is_a_configuration_error(tmp_path: Path) -> None:
    done = _export(tmp_path, OTEL_METRICS_EXPORTER="zipkin")
    assert done.returncode != 0
    assert "OTEL_METRICS_EXPORTER: zipkin is not supported" in done.stderr


@pytest.mark.parametrize("interval", ["0", "-5"])
def test_an_export_interval_below_one_is_a_configuration_error(
    tmp_path: Path, interval: str
) -> None:
    # The SDK's reader refuses it with a bare ValueError from deep inside it.
    done = _export(
        tmp_path,
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1",
        OTEL_METRIC_EXPORT_INTERVAL=interval,
    )
    assert done.returncode != 0
    assert "ConfigurationError: OTEL_METRIC_EXPORT_INTERVAL" in done.stderr
    assert "larger than zero" in done.stderr


class OnePiece:
    """A model that answers in one piece (no deltas): it has no time to first chunk."""

    name = "one-piece"
    provider = "scripted"

    async def stream(self, messages: Any, *, tools: Any, settings: Any) -> Any:
        yield ModelResponse(text="whole", usage=Usage(input_tokens=3, output_tokens=1))


async def test_a_call_answered_in_one_piece_records_a_duration_but_no_first_chunk(
    reader: MetricCapture,
) -> None:
    metrics = Metrics(CollectorRegistry(), meter_provider=reader.provider)
    agent = Agent("x", model=OnePiece(), telemetry=Telemetry(metrics=metrics, tracing=False))
    await agent.run("hi", session_id="s-whole")
    assert (
        reader.count("gen_ai.client.operation.duration", **{"gen_ai.request.model": "one-piece"})
        == 1
    )
    assert reader.points("gen_ai.client.operation.time_to_first_chunk") == []


async def test_openai_cache_figures_through_the_real_sdk_reach_spans_metrics_and_cost(
    reader: MetricCapture, registry: CollectorRegistry
) -> None:
    from loomflow.models import OpenAIModel, cost_usd
    from loomflow.testing.providers import FakeOpenAIAPI, Reply

    capture = SpanCapture()
    metrics = Metrics(registry, meter_provider=reader.provider)
    reply = Reply(text="Hi.", input_tokens=4000, output_tokens=10, cache_read_tokens=3072)
    with FakeOpenAIAPI(reply) as api:
        model = OpenAIModel("gpt-4.1", base_url=api.base_url, api_key="sk-test")
        telemetry = Telemetry(tracer_provider=capture.provider, metrics=metrics)
        result = await Agent("x", model=model, telemetry=telemetry).run("hi", session_id="s-oa")
        await model.aclose()
    [chat] = [s for s in capture.spans if s.name.startswith("chat")]
    assert chat.attributes["gen_ai.usage.input_tokens"] == 4000
    assert chat.attributes["gen_ai.usage.cache_read.input_tokens"] == 3072
    assert "gen_ai.usage.cache_creation.input_tokens" not in chat.attributes
    assert reader.total("loomflow.model.cache_tokens", provider="openai", type="read") == 3072
    # 928 uncached at $2, 3,072 cached at $0.50, 10 out at $8 (per million).
    expected = (928 * 2.0 + 3072 * 0.5 + 10 * 8.0) / 1e6
    assert result.cost_usd == pytest.approx(expected)
    assert reader.total("loomflow.model.cost.usd", provider="openai") == pytest.approx(expected)
    usage = Usage(input_tokens=4000, output_tokens=10, cache_read_tokens=3072)
    assert cost_usd("gpt-4.1", usage) == pytest.approx(expected)
    assert (
        reader.count(
            "gen_ai.client.operation.time_to_first_chunk",
            **{"gen_ai.provider.name": "openai", "gen_ai.request.model": "gpt-4.1"},
        )
        == 1
    )


async def test_each_meter_provider_gets_the_steps_once_however_registries_are_shared(
    tmp_path: Path, registry: CollectorRegistry
) -> None:
    """Steps and audit entries were observed once per Prometheus registry, OTel included: a
    second Metrics on the same registry with a meter provider of its own (an agent's
    ``Telemetry(meter_provider=...)`` next to the default telemetry) never got them, and one
    meter provider behind two registries got them twice."""
    from loomflow.audit import AuditLog, InMemoryAuditStore

    runtime = SqliteRuntime(tmp_path / "journal.db")
    audit = AuditLog(InMemoryAuditStore())
    first, second = MetricCapture(), MetricCapture()

    def agent(metrics: Metrics) -> Agent:
        return Agent(
            "x",
            model=ScriptedModel(["hi"] * 5),
            runtime=runtime,
            audit=audit,
            telemetry=Telemetry(metrics=metrics, tracing=False),
        )

    try:
        await agent(Metrics(registry, meter_provider=first.provider)).run("q", session_id="s1")
        # Same registry, another meter provider: its run's steps reach its provider.
        await agent(Metrics(registry, meter_provider=second.provider)).run("q", session_id="s2")
        # Another registry, the first provider again: its steps reach that provider once.
        await agent(Metrics(CollectorRegistry(), meter_provider=first.provider)).run(
            "q", session_id="s3"
        )
    finally:
        await runtime.close()

    prometheus = registry.get_sample_value(
        "loomflow_journal_steps_total", {"backend": "sqlite", "kind": "model", "outcome": "miss"}
    )
    assert prometheus == 3.0  # once per run on this registry, not once per Metrics
    first.collect()
    second.collect()
    assert first.total("loomflow.journal.steps", kind="model") == 3.0
    assert second.total("loomflow.journal.steps", kind="model") == 2.0  # s2 and s3
    audited = sum(
        sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == "loomflow_audit_entries_total"
    )
    assert audited > 0
    assert first.total("loomflow.audit.entries") == audited  # every entry, once
    assert 0 < second.total("loomflow.audit.entries") < audited  # those of s2 and s3
