"""Turn on span export and the metrics endpoint from settings (``LOOMFLOW_*``)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace

from ..config import Settings
from ..errors import ConfigurationError
from ._metrics import MetricsServer, serve_metrics

__all__ = ["TelemetrySetup", "setup_telemetry", "setup_telemetry_once"]

_INSTALL_HINT = (
    "exporting spans needs the OpenTelemetry SDK and OTLP exporter: pip install 'loomflow[otel]'"
)


@dataclass(eq=False)
class TelemetrySetup:
    """What :func:`setup_telemetry` started; :meth:`shutdown` flushes and stops it.

    Attributes:
        tracer_provider: The SDK provider exporting spans, or ``None`` when no OTLP endpoint
            is configured.
        metrics_server: The ``/metrics`` endpoint, or ``None`` when no port is configured.
    """

    tracer_provider: Any = None
    metrics_server: MetricsServer | None = None

    def shutdown(self) -> None:
        """Export the spans still buffered, then stop the exporter and the metrics server."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.metrics_server is not None:
            self.metrics_server.close()

    def __enter__(self) -> TelemetrySetup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def setup_telemetry(settings: Settings | None = None, *, set_global: bool = True) -> TelemetrySetup:
    """Configure the OpenTelemetry SDK and the metrics endpoint from ``settings``.

    With ``otlp_endpoint`` set, spans are batched and exported over OTLP/HTTP to
    ``<endpoint>/v1/traces`` (needs ``pip install 'loomflow[otel]'``); with ``metrics_port``
    set, prometheus-client's default registry is served at ``/metrics``. Either may be left
    unset. Call it once at process start, before building agents' ``Telemetry``.

    Args:
        settings: Defaults to ``Settings()`` (environment and ``.env``).
        set_global: Install the tracer provider as OpenTelemetry's global one, which
            ``Telemetry()`` uses by default. OpenTelemetry allows this once per process.

    Example:
        >>> # LOOMFLOW_OTLP_ENDPOINT=http://otel-collector:4318 LOOMFLOW_METRICS_PORT=9464
        >>> setup = setup_telemetry()  # doctest: +SKIP
        >>> agent = Agent("...", model="...", telemetry=Telemetry())  # doctest: +SKIP
    """
    s = settings or Settings()
    result = TelemetrySetup()
    _remember(s, result)  # so setup_telemetry_once after this reuses it (or refuses clearly)
    if s.otlp_endpoint:
        result.tracer_provider = _tracer_provider(s)
        if set_global:
            trace.set_tracer_provider(result.tracer_provider)
    if s.metrics_port is not None:
        try:
            result.metrics_server = serve_metrics(s.metrics_port, host=s.metrics_host)
        except OSError as exc:
            result.shutdown()
            raise ConfigurationError(
                f"cannot serve metrics on {s.metrics_host}:{s.metrics_port}: {exc}"
            ) from exc
    return result


_once_lock = threading.Lock()
_first_lock = threading.Lock()
_once: tuple[tuple[Any, ...], TelemetrySetup] | None = None


def _export_key(s: Settings) -> tuple[Any, ...]:
    return (s.otlp_endpoint, s.otlp_headers, s.otel_service_name, s.metrics_port, s.metrics_host)


def _remember(s: Settings, setup: TelemetrySetup) -> None:
    global _once
    with _once_lock:
        if _once is None:
            _once = (_export_key(s), setup)


def setup_telemetry_once(settings: Settings | None = None) -> TelemetrySetup:
    """:func:`setup_telemetry` for code that may run many times in one process.

    The first call sets telemetry up (the global tracer provider, the metrics endpoint); later
    calls with the same export settings return that setup, as do calls after the application
    ran :func:`setup_telemetry` itself. ``Agent.from_settings`` uses it, so several agents
    built from one configuration share one exporter and one port.

    Raises:
        ConfigurationError: this process already set telemetry up with a different endpoint,
            headers, service name or metrics address, which one process cannot serve twice.
    """
    s = settings or Settings()
    with _first_lock:  # two threads must not both bind the metrics port
        with _once_lock:
            existing = _once
        if existing is None:
            setup_telemetry(s)
            with _once_lock:
                existing = _once
    assert existing is not None
    if existing[0] != _export_key(s):
        raise ConfigurationError(
            "telemetry is already set up in this process with other export settings "
            "(OTLP endpoint, headers, service name or metrics address); one process "
            "exports to one place"
        )
    return existing[1]


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a receiver's base URL (kept as is if already complete)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigurationError(
            f"otlp_endpoint must be an http(s) URL like http://otel-collector:4318, "
            f"not {endpoint!r}"
        )
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else f"{base}/v1/traces"


def parse_headers(text: str | None) -> dict[str, str]:
    """``"a=1,b=2"`` → ``{"a": "1", "b": "2"}`` (the format of ``OTEL_EXPORTER_OTLP_HEADERS``)."""
    headers: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigurationError(f"otlp_headers: {item.strip()!r} is not name=value")
        headers[name.strip()] = value.strip()
    return headers


def _tracer_provider(s: Settings) -> Any:
    assert s.otlp_endpoint is not None
    url = traces_url(s.otlp_endpoint)
    headers = parse_headers(s.otlp_headers.get_secret_value() if s.otlp_headers else None)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    attributes: dict[str, str] = {}
    if s.otel_service_name:
        attributes["service.name"] = s.otel_service_name
    elif not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = "loomflow"
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, headers=headers)))
    return provider
