"""Settings turn on OTLP span export and the metrics endpoint, from the environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _otlp import Received
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from pydantic import SecretStr

from loomflow.config import Settings
from loomflow.errors import ConfigurationError
from loomflow.telemetry import setup_telemetry

WORKER = """
import asyncio, urllib.request
from loomflow.agent import Agent
from loomflow.models import ScriptedModel
from loomflow.runtime import InMemoryRuntime
from loomflow.telemetry import Telemetry, setup_telemetry

async def main():
    setup = setup_telemetry()
    agent = Agent("x", model=ScriptedModel(["hello"]), runtime=InMemoryRuntime(),
                  telemetry=Telemetry())
    await agent.run("hi", session_id="s-otlp", user_id="alice")
    with urllib.request.urlopen(setup.metrics_server.url, timeout=10) as response:
        body = response.read().decode()
    print("METRICS", setup.metrics_server.host, 'loomflow_runs_total{backend="memory"' in body)
    setup.shutdown()  # flushes the batched spans

asyncio.run(main())
"""


def _env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOMFLOW_", "OTEL_"))}
    env.update(values)
    return env


def _python(script: str, cwd: Path, *args: str, **values: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a new interpreter with ``values`` as its only LOOMFLOW_/OTEL_ settings."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        env=_env(**values),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _served_at_a_free_port(
    script: str, cwd: Path, **values: str
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a new interpreter with LOOMFLOW_METRICS_PORT a port that was free a
    moment ago (passed as the script's one argument too, so the caller can read it back)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    return _python(
        script, cwd, port, LOOMFLOW_METRICS_PORT=port, LOOMFLOW_METRICS_HOST="127.0.0.1", **values
    )


def test_the_environment_turns_on_otlp_export_and_the_metrics_endpoint(
    otlp_receiver: tuple[str, Received], tmp_path: Path
) -> None:
    url, received = otlp_receiver
    done = _python(
        WORKER,
        tmp_path,
        LOOMFLOW_OTLP_ENDPOINT=url,
        LOOMFLOW_OTLP_HEADERS="x-tenant=acme, x-team = sre",
        LOOMFLOW_OTEL_SERVICE_NAME="orders-agent",
        LOOMFLOW_METRICS_PORT="0",
        LOOMFLOW_METRICS_HOST="127.0.0.1",
    )
    assert done.returncode == 0, done.stderr
    assert "METRICS 127.0.0.1 True" in done.stdout
    assert received.paths
    assert set(received.paths) == {"/v1/traces"}
    assert received.headers[0]["x-tenant"] == "acme"
    assert received.headers[0]["x-team"] == "sre"
    assert received.headers[0]["content-type"] == "application/x-protobuf"
    names: set[str] = set()
    services: set[str] = set()
    step_users: set[str] = set()
    for body in received.bodies:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            for attribute in resource_spans.resource.attributes:
                if attribute.key == "service.name":
                    services.add(attribute.value.string_value)
            for scope_spans in resource_spans.scope_spans:
                assert scope_spans.scope.name == "loomflow"
                for span in scope_spans.spans:
                    names.add(span.name)
                    if span.name == "loom.workflow.step":
                        for attribute in span.attributes:
                            if attribute.key == "user.id":
                                step_users.add(attribute.value.string_value)
    assert names == {"invoke_agent agent", "loom.workflow.step", "chat scripted"}
    assert services == {"orders-agent"}
    assert step_users == {"alice"}


def test_settings_read_the_telemetry_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOMFLOW_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("LOOMFLOW_METRICS_PORT", "9464")
    monkeypatch.setenv("LOOMFLOW_METRICS_HOST", "127.0.0.1")
    monkeypatch.setenv("LOOMFLOW_TELEMETRY_CAPTURE_CONTENT", "1")
    s = Settings()
    assert s.otlp_endpoint == "http://collector:4318"
    assert s.metrics_port == 9464
    assert s.metrics_host == "127.0.0.1"
    assert s.telemetry_capture_content is True
    monkeypatch.setenv("LOOMFLOW_METRICS_PORT", "70000")
    with pytest.raises(ConfigurationError, match="LOOMFLOW_METRICS_PORT"):
        Settings()


def test_with_nothing_configured_nothing_starts() -> None:
    setup = setup_telemetry(Settings(otlp_endpoint=None, metrics_port=None), set_global=False)
    assert setup.tracer_provider is None
    assert setup.metrics_server is None
    setup.shutdown()


def test_a_provider_can_be_built_without_becoming_global(tmp_path: Path) -> None:
    from opentelemetry import trace

    before = trace.get_tracer_provider()
    with setup_telemetry(
        Settings(otlp_endpoint="http://127.0.0.1:9/v1/traces", metrics_port=None),
        set_global=False,
    ) as setup:
        assert setup.tracer_provider is not None
        assert trace.get_tracer_provider() is before


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"otlp_endpoint": "collector:4318"}, "must be an http"),
        ({"otlp_endpoint": "http://c:4318", "otlp_headers": "novalue"}, "not name=value"),
        ({"otlp_endpoint": "http://c:4318", "otlp_headers": "=x"}, "not name=value"),
    ],
)
def test_bad_export_settings_are_configuration_errors(
    options: dict[str, str], message: str
) -> None:
    # Refused with the other settings, before any command or agent runs...
    with pytest.raises(ConfigurationError, match=message.removeprefix("must be ")):
        Settings(metrics_port=None, **options)  # type: ignore[arg-type]
    # ...and by the set-up itself, for settings built around the checks.
    unchecked = Settings.model_construct(
        metrics_port=None,
        **{k: SecretStr(v) if k == "otlp_headers" else v for k, v in options.items()},
    )
    with pytest.raises(ConfigurationError, match=message):
        setup_telemetry(unchecked, set_global=False)


def test_a_metrics_port_in_use_is_a_configuration_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match=f"127.0.0.1:{port}"):
            setup_telemetry(
                Settings(metrics_port=port, metrics_host="127.0.0.1", otlp_endpoint=None),
                set_global=False,
            )


RETRY = """
import asyncio, os, socket
from opentelemetry import trace
from loomflow.agent import Agent
from loomflow.errors import ConfigurationError
from loomflow.models import ScriptedModel
from loomflow.runtime import InMemoryRuntime
from loomflow.telemetry import Telemetry, setup_telemetry_once

port = int(os.environ["LOOMFLOW_METRICS_PORT"])
taken = socket.socket()
taken.bind(("127.0.0.1", port))
taken.listen()
try:
    setup_telemetry_once()  # the port the environment names is in use
except ConfigurationError as exc:
    print("REFUSED", f"127.0.0.1:{port}" in str(exc))
# Nothing stays installed from the failed attempt.
print("GLOBAL AFTER FAILURE", type(trace.get_tracer_provider()).__name__)
taken.close()
setup = setup_telemetry_once()  # once the port is free, a retry really starts
print("SERVED", setup.metrics_server is not None and setup.metrics_server.port == port)
print("GLOBAL", trace.get_tracer_provider() is setup.tracer_provider)

async def main():
    agent = Agent("x", model=ScriptedModel(["hello"]), runtime=InMemoryRuntime(),
                  telemetry=Telemetry())
    await agent.run("hi", session_id="s-retry", user_id="alice")

asyncio.run(main())
setup.shutdown()  # flushes the batched spans
"""


def test_a_setup_that_failed_installs_nothing_and_a_retry_starts_everything(
    otlp_receiver: tuple[str, Received], tmp_path: Path
) -> None:
    """A failed setup (port in use) was remembered: setup_telemetry_once (Agent.from_settings)
    then returned it, with no metrics endpoint, and its shut-down tracer provider stayed the
    global one, so the retry's spans were lost."""
    url, received = otlp_receiver
    done = _served_at_a_free_port(RETRY, tmp_path, LOOMFLOW_OTLP_ENDPOINT=url)
    assert done.returncode == 0, done.stderr
    assert "REFUSED True" in done.stdout
    assert "GLOBAL AFTER FAILURE ProxyTracerProvider" in done.stdout
    assert "SERVED True" in done.stdout
    assert "GLOBAL True" in done.stdout
    assert received.bodies  # the retry's spans were exported


NO_SDK = """
import sys
sys.modules["opentelemetry.sdk"] = None  # as if the otel extra were not installed
from loomflow.config import Settings
from loomflow.telemetry import setup_telemetry
try:
    setup_telemetry(Settings(otlp_endpoint="http://127.0.0.1:4318"), set_global=False)
except ImportError as exc:
    print("HINT", exc)
"""


def test_export_without_the_sdk_says_what_to_install(tmp_path: Path) -> None:
    done = _python(NO_SDK, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "HINT" in done.stdout
    assert "pip install 'loomflow[otel]'" in done.stdout


def test_the_public_surface_is_exported_and_sorted() -> None:
    import loomflow.telemetry
    import loomflow.telemetry.testing

    for module in (loomflow.telemetry, loomflow.telemetry.testing):
        names = list(module.__all__)
        assert names == sorted(names), module.__name__
        for name in names:
            assert getattr(module, name) is not None


TWICE = """
import asyncio
from loomflow import Agent
from loomflow.errors import ConfigurationError
from loomflow.models import ScriptedModel
from loomflow.telemetry import setup_telemetry

async def build():
    async with Agent.from_settings("x", model=ScriptedModel(["hi"])) as agent:
        await agent.run("hi")

asyncio.run(build())  # Agent.from_settings started /metrics for this process
try:
    setup_telemetry()  # the README's telemetry section, run after it
except ConfigurationError as exc:
    print("REFUSED", exc)
"""


def test_a_second_setup_in_one_process_says_the_port_is_its_own(tmp_path: Path) -> None:
    """setup_telemetry() after Agent.from_settings (or twice, as a re-run notebook cell does)
    failed with "Address already in use", which sent the reader looking for another program
    on the port: the process itself serves it."""
    done = _served_at_a_free_port(TWICE, tmp_path, LOOMFLOW_RUNTIME_URL="memory://")
    assert done.returncode == 0, done.stderr
    port = done.args[-1]
    assert f"REFUSED cannot serve metrics on 127.0.0.1:{port}: this process serves" in done.stdout
    assert "setup_telemetry_once()" in done.stdout


SECOND_EXPORTER = """
import asyncio
from opentelemetry import trace
from loomflow.agent import Agent
from loomflow.errors import ConfigurationError
from loomflow.models import ScriptedModel
from loomflow.runtime import InMemoryRuntime
from loomflow.telemetry import setup_telemetry

first = setup_telemetry()
try:
    second = setup_telemetry()  # a re-run notebook cell, a second start-up hook
except ConfigurationError as exc:
    print("REFUSED", exc)
else:
    print("ACCEPTED, global is the second:", trace.get_tracer_provider() is second.tracer_provider)
agent = Agent("x", model=ScriptedModel(["hello"]), runtime=InMemoryRuntime())
asyncio.run(agent.run("hi", session_id="s-twice", user_id="alice"))
first.shutdown()
"""


def test_a_second_setup_without_a_metrics_port_is_refused_too(
    otlp_receiver: tuple[str, Received], tmp_path: Path
) -> None:
    """A second setup_telemetry() exporting spans returned a provider OpenTelemetry had not
    installed (it keeps the first and only logs a warning): shutting that one down flushed
    nothing, and its settings were silently ignored."""
    url, received = otlp_receiver
    done = _python(SECOND_EXPORTER, tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=url)
    assert done.returncode == 0, done.stderr
    assert "REFUSED" in done.stdout, done.stdout
    assert "setup_telemetry_once()" in done.stdout
    assert received.bodies  # the first setup still exports the run's spans
