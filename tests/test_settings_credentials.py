"""Settings that hold credentials never print them: repr, str, model_dump, `loomflow settings`."""

from __future__ import annotations

import json

import pytest
from pydantic import SecretStr

from loomflow.config import Settings

DSN = "postgresql://app:s3cret-pw@db:5432/app?sslmode=require&password=q-s3cret"
SECRETS = ("s3cret-pw", "q-s3cret", "tok-123", "hunter2-vault", "a-pass", "b-pass")


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> Settings:
    monkeypatch.chdir(str(tmp_path))  # no stray .env
    monkeypatch.setenv("LOOMFLOW_RUNTIME_URL", DSN)
    monkeypatch.setenv("LOOMFLOW_AUDIT_URL", "postgres://audit:a-pass@db/audit")
    monkeypatch.setenv("LOOMFLOW_BUDGET_URL", "postgresql://budget:b-pass@db/budget")
    monkeypatch.setenv("LOOMFLOW_OTLP_HEADERS", "authorization=Bearer tok-123")
    monkeypatch.setenv("LOOMFLOW_REDACT_SECRETS", '["hunter2-vault"]')
    return Settings()


def test_repr_str_and_dumps_mask_every_credential(loaded: Settings) -> None:
    shown = [
        repr(loaded),
        str(loaded),
        repr(loaded.model_dump()),
        json.dumps(loaded.model_dump(mode="json")),
        loaded.model_dump_json(),
    ]
    for text in shown:
        for secret in SECRETS:
            assert secret not in text, (secret, text)
    assert "postgresql://app:***@db:5432/app?sslmode=require&password=***" in repr(loaded)
    assert loaded.model_dump()["audit_url"] == "postgres://audit:***@db/audit"


def test_the_code_still_reads_the_real_values(loaded: Settings) -> None:
    assert loaded.runtime_url == DSN
    assert loaded.audit_store_url == "postgres://audit:a-pass@db/audit"
    assert loaded.budget_url == "postgresql://budget:b-pass@db/budget"
    assert isinstance(loaded.otlp_headers, SecretStr)
    assert loaded.otlp_headers.get_secret_value() == "authorization=Bearer tok-123"
    assert [s.get_secret_value() for s in loaded.redact_secrets] == ["hunter2-vault"]


def test_otlp_headers_still_reach_the_collector(loaded: Settings) -> None:
    # A real OTLP/HTTP request to a local receiver carries the header the secret holds.
    import http.server
    import threading

    from loomflow.telemetry._setup import _tracer_provider

    seen: list[str | None] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.headers.get("authorization"))
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), Receiver) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        provider = _tracer_provider(loaded.model_copy(update={"otlp_endpoint": endpoint}))
        try:
            provider.get_tracer("t").start_span("s").end()
            assert provider.force_flush(10_000)
        finally:
            provider.shutdown()
            server.shutdown()
    assert seen == ["Bearer tok-123"]


def test_a_url_without_a_password_is_shown_as_is() -> None:
    plain = Settings(runtime_url="postgresql://app@db/app")
    assert "postgresql://app@db/app" in repr(plain)
    assert Settings(runtime_url="sqlite:///x.db").model_dump()["runtime_url"] == "sqlite:///x.db"


def test_the_client_key_passphrase_is_masked_too() -> None:
    # libpq's and asyncpg's ?sslpassword= unlocks the client certificate's key: as much a
    # credential as ?password=.
    dsn = "postgresql://app@db/app?sslmode=verify-full&SSLPassword=k3y-pass&sslpassword=k3y-2"
    shown = Settings(runtime_url=dsn)
    for text in (repr(shown), shown.model_dump_json()):
        assert "k3y-pass" not in text, text
        assert "k3y-2" not in text, text
    assert shown.model_dump()["runtime_url"] == (
        "postgresql://app@db/app?sslmode=verify-full&SSLPassword=***&sslpassword=***"
    )
    assert shown.runtime_url == dsn
