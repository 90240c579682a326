"""The OpenTelemetry SDK's standard environment variables drive ``setup_telemetry()``.

Each case runs a real process (so the SDK sees the environment as a deployment sets it) that
exports to a real OTLP/HTTP receiver on loopback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from _otlp import Received
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from loomflow.config import Settings
from loomflow.errors import ConfigurationError
from loomflow.telemetry import setup_telemetry
from loomflow.telemetry._setup import parse_headers

WORKER = """
import asyncio
from loomflow.agent import Agent
from loomflow.models import ScriptedModel
from loomflow.runtime import InMemoryRuntime
from loomflow.telemetry import Telemetry, setup_telemetry

async def main():
    setup = setup_telemetry()
    print("PROVIDER", setup.tracer_provider is not None)
    agent = Agent("x", model=ScriptedModel(["hello"]), runtime=InMemoryRuntime(),
                  telemetry=Telemetry())
    await agent.run("hi", session_id="s-env", user_id="bob")
    setup.shutdown()  # flushes the batched spans

asyncio.run(main())
"""


def _only(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Set ``env`` as the only ``OTEL_*`` variables of this process."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def run_worker(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LOOMFLOW_", "OTEL_"))}
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-c", WORKER],
        env=clean,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def resources(received: Received) -> list[dict[str, str]]:
    found = []
    for body in received.bodies:
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            found.append({a.key: a.value.string_value for a in resource_spans.resource.attributes})
    return found


def span_names(received: Received) -> set[str]:
    return {
        span.name
        for body in received.bodies
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    }


def test_only_the_standard_endpoint_set_exports_spans(
    otlp_receiver: tuple[str, Received], tmp_path: Path
) -> None:
    url, received = otlp_receiver
    done = run_worker(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=url)
    assert done.returncode == 0, done.stderr
    assert "PROVIDER True" in done.stdout
    # The SDK appends the signal path to the base endpoint.
    assert set(received.paths) == {"/v1/traces"}
    assert {"invoke_agent agent", "loom.workflow.step", "chat scripted"} <= span_names(received)
    # No service name anywhere: ours rather than the SDK's "unknown_service".
    assert {r["service.name"] for r in resources(received)} == {"loomflow"}


def test_percent_encoded_standard_headers_arrive_decoded(
    otlp_receiver: tuple[str, Received], tmp_path: Path
) -> None:
    url, received = otlp_receiver
    done = run_worker(
        tmp_path,
        OTEL_EXPORTER_OTLP_ENDPOINT=url,
        OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20s3cr%3Dt,x-tenant=acme%2Ceu",
        OTEL_SERVICE_NAME="orders",
        OTEL_RESOURCE_ATTRIBUTES="deployment.environment=staging,team=sre",
    )
    assert done.returncode == 0, done.stderr
    assert received.headers
    assert received.headers[0]["authorization"] == "Bearer s3cr=t"
    assert received.headers[0]["x-tenant"] == "acme,eu"
    [resource, *_] = resources(received)
    assert resource["service.name"] == "orders"
    assert resource["deployment.environment"] == "staging"
    assert resource["team"] == "sre"


def test_loomflow_settings_override_the_standard_variables(
    otlp_receiver: tuple[str, Received], tmp_path: Path
) -> None:
    url, received = otlp_receiver
    done = run_worker(
        tmp_path,
        # The standard variables point elsewhere (port 9 discards): the overrides must win.
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
        OTEL_EXPORTER_OTLP_HEADERS="authorization=from-otel",
        OTEL_SERVICE_NAME="from-otel",
        LOOMFLOW_OTLP_ENDPOINT=url,
        LOOMFLOW_OTLP_HEADERS="authorization=Bearer%20from-loomflow",
        LOOMFLOW_OTEL_SERVICE_NAME="from-loomflow",
    )
    assert done.returncode == 0, done.stderr
    assert set(received.paths) == {"/v1/traces"}
    assert received.headers[0]["authorization"] == "Bearer from-loomflow"
    assert {r["service.name"] for r in resources(received)} == {"from-loomflow"}


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_SDK_DISABLED": "true"},
    ],
)
def test_the_standard_switches_turn_export_off(
    otlp_receiver: tuple[str, Received], tmp_path: Path, env: dict[str, str]
) -> None:
    url, received = otlp_receiver
    done = run_worker(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=url, **env)
    assert done.returncode == 0, done.stderr
    assert "PROVIDER False" in done.stdout
    assert received.bodies == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "zipkin is not supported"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf"),
    ],
)
def test_standard_settings_we_cannot_honour_are_configuration_errors(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=message):
        setup_telemetry(Settings(otlp_endpoint=None, metrics_port=None), set_global=False)


def test_loomflow_headers_are_percent_decoded_like_the_standard_ones() -> None:
    assert parse_headers("authorization=Bearer%20abc, x-a%2Db = 1%2C2") == {
        "authorization": "Bearer abc",
        "x-a-b": "1,2",
    }


def test_setup_is_requested_by_the_standard_endpoint_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loomflow.telemetry._setup import setup_requested

    for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_TRACES_EXPORTER",
        "OTEL_SDK_DISABLED",
    ):
        monkeypatch.delenv(name, raising=False)
    bare = Settings(otlp_endpoint=None, metrics_port=None)
    assert not setup_requested(bare)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert setup_requested(bare)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not setup_requested(bare)
    assert setup_requested(Settings(otlp_endpoint=None, metrics_port=0))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        # No scheme: the SDK took it and every export then failed, logged, for good.
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "otel-collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector/v1/traces"},
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ),
        (
            {
                "OTEL_TRACES_EXPORTER": "none",
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "collector:4318",
            },
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:99999"}, "bad port"),
        # A header item without "=" was dropped with a warning, so the collector refused
        # every export for want of its token.
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=acme,Bearer%20sk-live-abc",
            },
            "OTEL_EXPORTER_OTLP_HEADERS: item 2 is not name=value",
        ),
        (
            {
                "OTEL_TRACES_EXPORTER": "none",
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "sk-live-abc",
            },
            "OTEL_EXPORTER_OTLP_METRICS_HEADERS: item 1 is not name=value",
        ),
        # Pushed metrics over gRPC went out as http/protobuf to the gRPC port, unsaid.
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                "OTEL_TRACES_EXPORTER": "none",
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc",
            },
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL='grpc'",
        ),
        # A CA file that is not there: every export failed to open it, logged, for good.
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "https://127.0.0.1:9",
                "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem",
            },
            "OTEL_EXPORTER_OTLP_CERTIFICATE: no readable file at '/nonexistent/ca.pem'",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "https://127.0.0.1:9",
                "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": "/nonexistent/client.key",
            },
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY: no readable file",
        ),
        # Not a number: the SDK pushed every 60 s instead, with only a logged warning (while
        # 0 or a negative number was refused).
        (
            {
                "OTEL_TRACES_EXPORTER": "none",
                "OTEL_METRICS_EXPORTER": "console",
                "OTEL_METRIC_EXPORT_INTERVAL": "10s",
            },
            "OTEL_METRIC_EXPORT_INTERVAL='10s'",
        ),
        # Not whole numbers: the SDK logged a traceback and batched with its default instead.
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_BSP_SCHEDULE_DELAY": "abc"},
            "OTEL_BSP_SCHEDULE_DELAY='abc': give a whole number of milliseconds",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_EXPORT_TIMEOUT": "30s"},
            "OTEL_BSP_EXPORT_TIMEOUT='30s'",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_BSP_MAX_QUEUE_SIZE": "lot"},
            "OTEL_BSP_MAX_QUEUE_SIZE='lot': give a whole number of spans",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "51.2",
            },
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE='51.2'",
        ),
        # The SDK's own checks raised a bare ValueError from deep inside it.
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_BSP_MAX_QUEUE_SIZE": "-5"},
            "max_queue_size must be a positive integer",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "many",
            },
            "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT must be a non-negative integer",
        ),
        # The meter provider refused it with a bare ValueError (the run never started).
        (
            {
                "OTEL_TRACES_EXPORTER": "none",
                "OTEL_METRICS_EXPORTER": "console",
                "OTEL_METRICS_EXEMPLAR_FILTER": "sometimes",
            },
            "Unknown exemplar filter 'sometimes'",
        ),
    ],
)
def test_bad_standard_values_are_configuration_errors(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    _only(monkeypatch, env)
    with pytest.raises(ConfigurationError, match=re.escape(message)) as raised:
        setup_telemetry(Settings(otlp_endpoint=None, metrics_port=None), set_global=False)
    assert "sk-live" not in str(raised.value)


def test_a_standard_endpoint_is_quoted_without_its_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _only(monkeypatch, {})
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://user:hunter22@collector:4318")
    with pytest.raises(ConfigurationError, match="OTEL_EXPORTER_OTLP_ENDPOINT") as raised:
        setup_telemetry(Settings(otlp_endpoint=None, metrics_port=None), set_global=False)
    assert "hunter22" not in str(raised.value)


def test_a_refused_meter_provider_leaves_no_export_thread_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The readers start their export threads before the provider checks its variables.
    _only(
        monkeypatch,
        {
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRICS_EXPORTER": "console",
            "OTEL_METRICS_EXEMPLAR_FILTER": "sometimes",
        },
    )
    before = set(threading.enumerate())
    with pytest.raises(ConfigurationError, match="OTEL_METRICS_EXEMPLAR_FILTER"):
        setup_telemetry(Settings(otlp_endpoint=None, metrics_port=None), set_global=False)
    assert [t for t in threading.enumerate() if t not in before and t.is_alive()] == []


def test_an_empty_batch_variable_is_unset_without_a_logged_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The SDK read an empty OTEL_BSP_* value with int(), logged the ValueError's traceback
    # and used its default; an empty value means unset, as for every other variable.
    _only(
        monkeypatch,
        {
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_BSP_SCHEDULE_DELAY": "",
            "OTEL_BSP_MAX_QUEUE_SIZE": " ",
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64",
        },
    )
    with caplog.at_level("DEBUG"):
        setup = setup_telemetry(Settings(otlp_endpoint=None, metrics_port=None), set_global=False)
    try:
        assert [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"] == []
        assert setup.tracer_provider is not None
    finally:
        setup.shutdown()
