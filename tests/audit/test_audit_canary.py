"""Canary values must never reach the audit store, the journal, spans or logs.

One run (and its resumption) uses a card number that a tool declares sensitive, an API key in
the prompt and in an argument, and a configured secret in an argument and a tool result; a tool
also fails with the card number in its exception. Then the raw bytes of every store, every
finished span and every log record are searched for the three values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loomflow.agent import Agent
from loomflow.audit import AuditLog, SqliteAuditStore
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime
from loomflow.telemetry import Telemetry
from loomflow.telemetry.testing import SpanCapture
from loomflow.tools import tool

CARD = "4111-CANARY-CARD-7731"
API_KEY = "sk-CANARYkey0123456789abcdef"
SECRET = "canary-configured-s3cret"
CANARIES = (CARD, API_KEY, SECRET)


@tool(sensitive=("card",))
def pay(card: str, note: str) -> str:
    """Charge a card."""
    return f"charged {card}; config {SECRET}"


@tool(sensitive=("card",))
def check_card(card: str) -> str:
    """Check a card."""
    raise ValueError(f"card {card} is blocked")


# A sensitive value too short for the redactor to learn (it would vanish from every text),
# echoed by the tool's own error: only the phrase is a canary.
CVV = "#7~"
CVV_ECHO = f"cvv {CVV} does not match"


@tool(sensitive=("cvv",))
def check_cvv(cvv: str) -> str:
    """Check a card's security code."""
    raise ValueError(CVV_ECHO)


def script(messages: list[Message], tools: list[ToolSpec]) -> Any:
    if any(m.role == "tool" for m in messages):
        return "done"
    return [
        ToolCall(id="a", name="pay", arguments={"card": CARD, "note": f"{API_KEY} {SECRET}"}),
        ToolCall(id="b", name="check_card", arguments={"card": CARD}),
        ToolCall(id="c", name="check_cvv", arguments={"cvv": CVV}),
    ]


@dataclass
class Traces:
    journal: bytes
    audit: bytes
    spans: str
    logs: str


def _raw(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))


@pytest.fixture
async def traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> Traces:
    monkeypatch.setenv("LOOMFLOW_REDACT_SECRETS", f'["{SECRET}"]')
    capture = SpanCapture()
    runtime = SqliteRuntime(tmp_path / "journal.db")
    audit = AuditLog(SqliteAuditStore(tmp_path / "audit.db"))

    def agent() -> Agent:
        return Agent(
            "You pay bills.",
            model=FunctionModel(script),
            tools=[pay, check_card, check_cvv],
            runtime=runtime,
            audit=audit,
            telemetry=Telemetry(tracer_provider=capture.provider, metrics=False),
        )

    with caplog.at_level(logging.DEBUG):
        first = await agent().run(f"pay it, key {API_KEY}", session_id="s", user_id="alice")
        again = await agent().resume(f"pay it, key {API_KEY}", session_id="s", user_id="alice")
    assert first.output == again.output == "done"
    assert again.replayed_steps > 0
    await runtime.close()
    await audit.close()
    spans = []
    for span in capture.spans:
        spans.append(span.name)
        spans.extend(f"{k}={v}" for k, v in (span.attributes or {}).items())
        for event in span.events:
            spans.append(event.name)
            spans.extend(f"{k}={v}" for k, v in (event.attributes or {}).items())
    logs = caplog.text + "\n".join(r.getMessage() for r in caplog.records)
    # The failing tool was logged (with its traceback), so the log path was exercised.
    assert "tool 'check_card' raised" in logs
    assert "[REDACTED]" in logs
    return Traces(
        _raw(tmp_path / "journal.db"), _raw(tmp_path / "audit.db"), "\n".join(spans), logs
    )


def test_canaries_never_reach_the_audit_store(traces: Traces) -> None:
    assert b"tool.replay" in traces.audit  # the store holds the trail...
    for canary in CANARIES:
        assert canary.encode() not in traces.audit  # ...but none of the secrets


def test_canaries_never_reach_spans(traces: Traces) -> None:
    assert "execute_tool pay" in traces.spans
    for canary in CANARIES:
        assert canary not in traces.spans


def test_canaries_never_reach_logs(traces: Traces) -> None:
    for canary in CANARIES:
        assert canary not in traces.logs


def test_canaries_never_reach_the_journal(traces: Traces) -> None:
    assert b"model_call_0" in traces.journal
    for canary in CANARIES:
        assert canary.encode() not in traces.journal


def test_a_short_sensitive_value_its_tool_echoes_reaches_no_store(traces: Traces) -> None:
    # A sensitive value shorter than 4 characters (a CVV) is not learned by the redactor,
    # and the tool's error that echoed it was journaled and audited as it was.
    hidden = CVV_ECHO.replace(CVV, "[REDACTED]")
    assert hidden.encode() in traces.audit
    for where in (traces.journal, traces.audit, traces.spans.encode()):
        assert CVV_ECHO.encode() not in where
