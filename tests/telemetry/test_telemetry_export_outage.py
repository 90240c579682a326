"""A collector that is down is logged once per outage, not on every batch."""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loomflow.config import Settings
from loomflow.telemetry import setup_telemetry


def _refused_port() -> int:
    """A loopback port nothing listens on (bound, then closed): connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class _Ok(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_collector_outage_is_logged_once_then_its_recovery(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # With the collector down, the SDK logged each failed batch (and each retry of it) for as
    # long as the outage lasted.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # seconds: one quick try per batch
    port = _refused_port()
    caplog.set_level(logging.WARNING)
    with setup_telemetry(
        Settings(otlp_endpoint=f"http://127.0.0.1:{port}", metrics_port=None), set_global=False
    ) as setup:
        provider = setup.tracer_provider
        assert provider is not None
        tracer = provider.get_tracer("test")
        for batch in range(4):
            with tracer.start_as_current_span(f"refused-{batch}"):
                pass
            provider.force_flush()
        failures = [r for r in caplog.records if "export" in r.getMessage().lower()]
        ours = [r.getMessage() for r in failures if r.name == "loomflow.telemetry"]
        assert len(ours) == 1, [r.getMessage() for r in failures]
        assert "OTLP span export failed" in ours[0]
        # The SDK's own lines say why, for the first failed batch only.
        sdk = [r for r in failures if r.name.startswith("opentelemetry")]
        assert sdk, "the first failure's reason is still logged"
        caplog.clear()

        server = ThreadingHTTPServer(("127.0.0.1", port), _Ok)  # the collector is back
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            with tracer.start_as_current_span("delivered"):
                pass
            provider.force_flush()
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
        lines = [r.getMessage() for r in caplog.records]
        assert lines == ["OTLP span export recovered; 4 batch(es) were lost while it failed"]
