"""Turn on span export and the metrics endpoint from settings.

Span export follows the OpenTelemetry SDK's own environment variables (``OTEL_EXPORTER_OTLP_*``,
``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_EXPORTER``, ...): the SDK's
exporter and resource read them, so a deployment configured for any OpenTelemetry service works
unchanged. The ``LOOMFLOW_OTLP_*`` settings, where set, override them.

Metric export over OTLP is asked for explicitly, with ``OTEL_METRICS_EXPORTER=otlp``: the same
figures are already served to Prometheus by pull, and pushing them as well, unasked, to a
collector that Prometheus also scrapes would count every series twice.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from opentelemetry import metrics, trace

from ..config import Settings, _masked_url, check_otlp_headers, check_otlp_url
from ..errors import ConfigurationError
from ._metrics import MetricsServer, serve_metrics

__all__ = ["TelemetrySetup", "setup_telemetry", "setup_telemetry_once"]

log = logging.getLogger("loomflow.telemetry")

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
        meter_provider: The SDK provider exporting OTel metrics, or ``None`` unless
            ``OTEL_METRICS_EXPORTER`` asks for it.
    """

    tracer_provider: Any = None
    metrics_server: MetricsServer | None = None
    meter_provider: Any = None

    def shutdown(self) -> None:
        """Export the spans and metrics still buffered, then stop the exporters and the
        metrics server."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()
        if self.metrics_server is not None:
            self.metrics_server.close()

    def __enter__(self) -> TelemetrySetup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def setup_telemetry(settings: Settings | None = None, *, set_global: bool = True) -> TelemetrySetup:
    """Configure the OpenTelemetry SDK and the metrics endpoint from ``settings``.

    Spans are batched and exported over OTLP/HTTP (needs ``pip install 'loomflow[otel]'``)
    when ``otlp_endpoint`` is set or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is, unless ``OTEL_TRACES_EXPORTER=none`` or
    ``OTEL_SDK_DISABLED=true``. The SDK reads the other ``OTEL_*`` variables itself (headers,
    timeout, compression, certificates, service name, resource attributes); ``otlp_endpoint``,
    ``otlp_headers`` and ``otel_service_name`` override them. With ``metrics_port`` set,
    prometheus-client's default registry is served at ``/metrics``. Either may be left unset.
    With ``OTEL_METRICS_EXPORTER=otlp`` (or ``console``) the OTel metrics are also exported,
    every ``OTEL_METRIC_EXPORT_INTERVAL`` milliseconds (default 60 000), to the same endpoint
    (``/v1/metrics``) or ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``. Call it once at process
    start, before building agents' ``Telemetry``.

    Args:
        settings: Defaults to ``Settings()`` (environment and ``.env``).
        set_global: Install the tracer (and meter) provider as OpenTelemetry's global one,
            which ``Telemetry()`` uses by default. OpenTelemetry allows this once per process.

    Example:
        >>> # LOOMFLOW_OTLP_ENDPOINT=http://otel-collector:4318 LOOMFLOW_METRICS_PORT=9464
        >>> setup = setup_telemetry()  # doctest: +SKIP
        >>> agent = Agent("...", model="...", telemetry=Telemetry())  # doctest: +SKIP
    """
    s = settings or Settings()
    if set_global:
        _refuse_second_global(s)
    result = TelemetrySetup()
    try:
        if _exports_spans(s):
            result.tracer_provider = _tracer_provider(s)
        if _exports_metrics(s):
            result.meter_provider = _meter_provider(s)
        if s.metrics_port is not None:
            try:
                result.metrics_server = serve_metrics(s.metrics_port, host=s.metrics_host)
            except ConfigurationError as exc:
                _refuse_if_served_here(s, exc)
                raise
    except BaseException:
        result.shutdown()
        raise
    # Installed and remembered only once everything started: a setup that failed (a port in
    # use, a bad export interval) must leave no shut-down provider as the global one, which
    # OpenTelemetry never lets go, nor be what setup_telemetry_once hands a retry.
    global _installed
    if set_global:
        if result.tracer_provider is not None:
            trace.set_tracer_provider(result.tracer_provider)
        if result.meter_provider is not None:
            metrics.set_meter_provider(result.meter_provider)
        if result.tracer_provider is not None or result.meter_provider is not None:
            with _once_lock:
                _installed = _installed or result
    _remember(s, result)  # so setup_telemetry_once after this reuses it (or refuses clearly)
    return result


_once_lock = threading.Lock()
_first_lock = threading.Lock()
_once: tuple[tuple[Any, ...], TelemetrySetup] | None = None


def _export_key(s: Settings) -> tuple[Any, ...]:
    otel = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("OTEL_")))
    return (
        s.otlp_endpoint,
        s.otlp_headers,
        s.otel_service_name,
        s.metrics_port,
        s.metrics_host,
        otel,
    )


# The setup whose providers this process installed as OpenTelemetry's global ones: the SDK
# keeps the first for good and ignores a later one with only a logged warning.
_installed: TelemetrySetup | None = None


def _refuse_second_global(s: Settings) -> None:
    with _once_lock:
        installed = _installed
    if installed is None:
        return
    spans = installed.tracer_provider is not None and _exports_spans(s)
    if spans or (installed.meter_provider is not None and _exports_metrics(s)):
        raise ConfigurationError(
            "telemetry is already set up in this process (an earlier setup_telemetry() or "
            "Agent.from_settings installed its "
            f"{'tracer' if spans else 'meter'} provider, which OpenTelemetry keeps for good): "
            "call setup_telemetry() once, at start, or setup_telemetry_once(), which returns "
            "the running setup; setup_telemetry(set_global=False) builds a provider to pass "
            "on yourself"
        )


def _remember(s: Settings, setup: TelemetrySetup) -> None:
    global _once
    with _once_lock:
        if _once is None:
            _once = (_export_key(s), setup)


def _refuse_if_served_here(s: Settings, exc: ConfigurationError) -> None:
    """The port is taken by this process's own earlier setup (Agent.from_settings, or a
    notebook cell run again): say so, rather than send the reader looking for another
    program behind "Address already in use"."""
    with _once_lock:
        server = _once[1].metrics_server if _once is not None else None
    if (
        server is not None
        and (server.host, server.port) == (s.metrics_host, s.metrics_port)
        and server._thread.is_alive()  # not shut down since
    ):
        raise ConfigurationError(
            f"cannot serve metrics on {server.host}:{server.port}: this process serves "
            "/metrics there already (an earlier setup_telemetry() or Agent.from_settings); "
            "call setup_telemetry() once, at start, or setup_telemetry_once(), which returns "
            "the running setup"
        ) from exc


def already_set_up() -> bool:
    """Whether this process ran :func:`setup_telemetry` (or ``setup_telemetry_once``)."""
    with _once_lock:
        return _once is not None


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
            f"not {_masked_url(endpoint)!r}"
        )
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else f"{base}/v1/traces"


def _standard(signal: str, variable: str, check: Callable[[str], object]) -> None:
    """Check the standard variable the SDK will read for ``signal`` (``OTEL_EXPORTER_OTLP_
    <SIGNAL>_<variable>``, else ``OTEL_EXPORTER_OTLP_<variable>``) as loomflow's own setting
    is checked: the SDK takes a bad endpoint (every export then fails, logged, for good) and
    drops a bad header item with a warning (the collector then refuses every export)."""
    for name in (
        f"OTEL_EXPORTER_OTLP_{signal.upper()}_{variable}",
        f"OTEL_EXPORTER_OTLP_{variable}",
    ):
        value = os.environ.get(name, "").strip()
        if value:
            try:
                check(value)
            except ValueError as exc:
                raise ConfigurationError(f"{name}: {exc}") from None
            return  # the signal's own variable wins over the base one, as in the SDK


def _readable_file(path: str) -> None:
    if not os.access(path, os.R_OK) or not os.path.isfile(path):
        raise ValueError(f"no readable file at {path!r}")


def _standard_endpoint_and_headers(s: Settings, signal: str) -> None:
    if not s.otlp_endpoint:
        _standard(signal, "ENDPOINT", check_otlp_url)
    if s.otlp_headers is None:
        _standard(signal, "HEADERS", check_otlp_headers)
    for variable in ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE"):
        _standard(signal, variable, _readable_file)


def _http_protobuf(signal: str) -> None:
    """Refuse another OTLP protocol for ``signal``: loomflow's exporters speak http/protobuf."""
    name = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
    if not os.environ.get(name, "").strip():
        name = "OTEL_EXPORTER_OTLP_PROTOCOL"
    protocol = os.environ.get(name, "").strip()
    if protocol not in ("", "http/protobuf"):
        raise ConfigurationError(
            f"{name}={protocol!r}: loomflow exports {signal} over http/protobuf (port 4318 on "
            "a collector); set it to http/protobuf or unset it"
        )


def _sdk_refused(exc: ValueError) -> ConfigurationError:
    """The SDK's own check of an ``OTEL_*`` value (a queue size, a limit), as a setting error."""
    return ConfigurationError(
        f"the OpenTelemetry SDK refused its OTEL_* settings: {' '.join(str(exc).split())}"
    )


def signal_url(endpoint: str, signal: str) -> str:
    """The OTLP/HTTP URL of ``signal`` (``traces``, ``metrics``) from a receiver's base URL."""
    base = traces_url(endpoint).removesuffix("/v1/traces")
    return base if base.endswith(f"/v1/{signal}") else f"{base}/v1/{signal}"


def parse_headers(text: str | None) -> dict[str, str]:
    """``"a=1,b=2"`` → ``{"a": "1", "b": "2"}`` (the format of ``OTEL_EXPORTER_OTLP_HEADERS``).

    Names and values are percent-decoded, as the OpenTelemetry specification asks
    (``authorization=Bearer%20abc`` sends ``Bearer abc``).
    """
    headers: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigurationError(f"otlp_headers: {item.strip()!r} is not name=value")
        headers[unquote(name.strip())] = unquote(value.strip())
    return headers


_EXPORTERS = frozenset({"otlp", "console", "none"})


def _traces_exporters() -> list[str]:
    """``OTEL_TRACES_EXPORTER`` as a list (default ``otlp``), checked against what we build."""
    raw = os.environ.get("OTEL_TRACES_EXPORTER", "otlp")
    names = [n.strip().lower() for n in raw.split(",") if n.strip()] or ["otlp"]
    unknown = sorted(set(names) - _EXPORTERS)
    if unknown:
        raise ConfigurationError(
            f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} is not supported here; "
            "use otlp, console or none"
        )
    return [n for n in names if n != "none"]


def setup_requested(s: Settings) -> bool:
    """Whether :func:`setup_telemetry` would start anything for ``s`` and the environment.

    For callers that set telemetry up only when configured (``Agent.from_settings``): span
    export through the standard ``OTEL_*`` variables counts as configured.
    """
    return s.metrics_port is not None or _exports_spans(s) or _exports_metrics(s)


def _exports_spans(s: Settings) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _traces_exporters()
    if "console" in exporters:
        return True
    if "otlp" not in exporters:
        return False
    return bool(
        s.otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _metrics_exporters() -> list[str]:
    """``OTEL_METRICS_EXPORTER`` as a list: empty unless set (see the module docstring)."""
    raw = os.environ.get("OTEL_METRICS_EXPORTER", "")
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    unknown = sorted(set(names) - _EXPORTERS - {"prometheus"})
    if unknown:
        raise ConfigurationError(
            f"OTEL_METRICS_EXPORTER: {', '.join(unknown)} is not supported here; "
            "use otlp, console or none (Prometheus pull is LOOMFLOW_METRICS_PORT)"
        )
    return [n for n in names if n in ("otlp", "console")]


def _exports_metrics(s: Settings) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _metrics_exporters()
    if "console" in exporters:
        return True
    return "otlp" in exporters and bool(
        s.otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _resource(s: Settings) -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; without either
    # the SDK names the service "unknown_service", which says less than "loomflow".
    resource = Resource.create({SERVICE_NAME: s.otel_service_name} if s.otel_service_name else {})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "loomflow"}))
    return resource


_EXEMPLAR_FILTERS = ("trace_based", "always_on", "always_off")

# What the SDK's batch span processor reads with int(); one that is not a whole number (an
# empty one too) it replaced with its default, saying so only in a logged traceback. They are
# read here and handed to it, each with its argument and the specification's default.
_BSP_NUMBERS = {
    "OTEL_BSP_SCHEDULE_DELAY": ("schedule_delay_millis", 5000, "milliseconds"),
    "OTEL_BSP_EXPORT_TIMEOUT": ("export_timeout_millis", 30000, "milliseconds"),
    "OTEL_BSP_MAX_QUEUE_SIZE": ("max_queue_size", 2048, "spans"),
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": ("max_export_batch_size", 512, "spans"),
}


def _batch_options() -> dict[str, Any]:
    """The batch span processor's arguments from OTEL_BSP_* (an empty one is unset)."""
    options: dict[str, Any] = {}
    for name, (argument, default, unit) in _BSP_NUMBERS.items():
        _sdk_number(name, int, f"a whole number of {unit}, like {default}")
        value = os.environ.get(name, "").strip()
        options[argument] = int(value) if value else default
    return options


def _sdk_number(name: str, parse: Callable[[str], object], hint: str) -> None:
    """Refuse a standard variable ``parse`` (as the SDK parses it) cannot read."""
    value = os.environ.get(name, "")
    try:
        _ = parse(value) if value.strip() else None  # empty: unset, the default
    except ValueError:
        raise ConfigurationError(f"{name}={value!r}: give {hint}") from None


def _meter_provider(s: Settings) -> Any:
    exporters = _metrics_exporters()
    headers = (
        parse_headers(s.otlp_headers.get_secret_value()) if s.otlp_headers is not None else None
    )
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import (
            ConsoleMetricExporter,
            PeriodicExportingMetricReader,
        )
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc

    def periodic(exporter: Any) -> Any:
        # The reader reads OTEL_METRIC_EXPORT_INTERVAL and _TIMEOUT itself, and refuses 0 or
        # a negative one with a bare ValueError from deep inside the SDK; one that is not a
        # number it replaces with its default, saying so only in a log line.
        for name in ("OTEL_METRIC_EXPORT_INTERVAL", "OTEL_METRIC_EXPORT_TIMEOUT"):
            _sdk_number(name, float, "a number of milliseconds, like 60000")
        try:
            return PeriodicExportingMetricReader(exporter)
        except ValueError as exc:
            raise ConfigurationError(
                "OTEL_METRIC_EXPORT_INTERVAL and OTEL_METRIC_EXPORT_TIMEOUT must be positive "
                f"numbers of milliseconds: {' '.join(str(exc).split())}"
            ) from None

    # The provider reads this one only once the readers run their export threads, and
    # refused an unknown value with a bare ValueError, leaving those threads running.
    exemplars = os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER", "trace_based")
    if exemplars not in _EXEMPLAR_FILTERS:  # as the SDK compares: exactly
        raise ConfigurationError(
            f"OTEL_METRICS_EXEMPLAR_FILTER={exemplars!r}: Unknown exemplar filter "
            f"{exemplars!r}; use one of {', '.join(_EXEMPLAR_FILTERS)} or unset it"
        )
    readers = []
    if "otlp" in exporters:
        _http_protobuf("metrics")
        _standard_endpoint_and_headers(s, "metrics")
        # None lets the SDK read OTEL_EXPORTER_OTLP_(METRICS_)ENDPOINT itself.
        url = signal_url(s.otlp_endpoint, "metrics") if s.otlp_endpoint else None
        exporter = _METRIC_OUTAGES.watch(OTLPMetricExporter(endpoint=url, headers=headers))
        readers.append(periodic(exporter))
    if "console" in exporters:
        readers.append(periodic(ConsoleMetricExporter()))
    try:
        return MeterProvider(resource=_resource(s), metric_readers=readers)
    except ValueError as exc:  # any other OTEL_* value it refuses: stop the readers' threads
        for reader in readers:
            reader.shutdown()
        raise _sdk_refused(exc) from None


def _tracer_provider(s: Settings) -> Any:
    exporters = _traces_exporters()
    # None lets the SDK's exporter read OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT / _HEADERS itself
    # (it appends /v1/traces to the base endpoint and percent-decodes the headers).
    url = traces_url(s.otlp_endpoint) if s.otlp_endpoint else None
    headers = (
        parse_headers(s.otlp_headers.get_secret_value()) if s.otlp_headers is not None else None
    )
    if "otlp" in exporters:
        _http_protobuf("traces")
        _standard_endpoint_and_headers(s, "traces")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    batch = _batch_options() if "otlp" in exporters or "console" in exporters else {}
    try:
        provider = TracerProvider(resource=_resource(s))  # reads the OTEL_*_LIMIT variables
        processors = []  # built before any is added, so a refused option starts none
        if "otlp" in exporters:
            exporter = _SPAN_OUTAGES.watch(OTLPSpanExporter(endpoint=url, headers=headers))
            processors.append(BatchSpanProcessor(exporter, **batch))
        if "console" in exporters:
            processors.append(BatchSpanProcessor(ConsoleSpanExporter(), **batch))
    except ValueError as exc:
        raise _sdk_refused(exc) from None
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


class _ExportOutages(logging.Filter):
    """One signal's OTLP export failures, logged once per outage instead of on every batch.

    The SDK's exporter logs each failed batch (and each retry of it): with the collector
    down, that is a few lines every few seconds for as long as it stays down. Its lines are
    let through for the first failed batch (they say why), then a line of ours says the
    export is failing; later failed batches are quiet until one goes through, which a
    "recovered" line reports with the count of batches lost meanwhile.
    """

    _SDK_LINES = ("Failed to export", "Transient error")

    def __init__(self, signal: str, sdk_logger: str) -> None:
        super().__init__()
        self.signal = signal
        self.sdk_logger = sdk_logger
        self.failed = 0  # batches failed since the last that went through
        self._lock = threading.Lock()
        self._installed = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            self.failed and isinstance(record.msg, str) and record.msg.startswith(self._SDK_LINES)
        )

    def watch(self, exporter: Any) -> Any:
        """``exporter`` (an SDK OTLP exporter), its ``export`` reporting to this outage log."""
        with self._lock:
            if not self._installed:
                logging.getLogger(self.sdk_logger).addFilter(self)
                self._installed = True
        export = exporter.export

        def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                result = export(*args, **kwargs)
            except BaseException:
                self.note(ok=False)
                raise
            self.note(ok=getattr(result, "name", None) == "SUCCESS")
            return result

        exporter.export = watched
        return exporter

    def note(self, *, ok: bool) -> None:
        with self._lock:
            if ok:
                if self.failed:
                    log.warning(
                        "OTLP %s export recovered; %d batch(es) were lost while it failed",
                        self.signal,
                        self.failed,
                    )
                self.failed = 0
                return
            self.failed += 1
            if self.failed == 1:
                log.warning(
                    "OTLP %s export failed (is the collector up?); further failures are not "
                    "logged until an export goes through again",
                    self.signal,
                )


_SPAN_OUTAGES = _ExportOutages("span", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
_METRIC_OUTAGES = _ExportOutages("metric", "opentelemetry.exporter.otlp.proto.http.metric_exporter")
