"""Personal data in tool results: sealed out of every store, redacted from the audit log."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from loomflow.agent import Agent, Tuning
from loomflow.audit import AuditLog, InMemoryAuditStore, Redactor, audit_store_beside
from loomflow.audit.sealing import SEALED_RESULT_LOST, Sealer
from loomflow.config import Settings
from loomflow.errors import UserError
from loomflow.memory import memory_for
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import InMemoryRuntime, SqliteRuntime, runtime_from_url
from loomflow.tools import ToolOutcome, tool

CARD = "4111 1111 1111 1111"  # Luhn-valid test card
EMAIL = "ana.lopez@example.com"
IBAN = "DE89 3704 0044 0532 0130 00"
ADDRESS = "17 Rue des Lilas, Lyon"  # no shape any redactor knows: only sealing hides it
OTHER_CARD = "5555-5555-5555-4444"
OTHER_EMAIL = "bo.chen@example.org"
# Every spelling a store could hold them in.
SEALED_VALUES = (CARD, CARD.replace(" ", ""), EMAIL, ADDRESS)
REDACTED_VALUES = (OTHER_CARD, OTHER_CARD.replace("-", ""), OTHER_EMAIL)

ran: list[str] = []


@tool(sensitive_result=True)
def lookup_customer(customer_id: str) -> dict[str, str]:
    """Find a customer's card and e-mail."""
    ran.append(customer_id)
    return {"name": "Ana", "card": CARD, "email": EMAIL, "address": ADDRESS}


@tool
def last_contact(customer_id: str) -> str:
    """How the customer last got in touch (not marked sensitive)."""
    return f"wrote from {OTHER_EMAIL}, paid with {OTHER_CARD}"


def plan(messages: list[Message], tools: list[ToolSpec]) -> Any:
    done = sum(1 for m in messages if m.role == "tool")
    if done == 0:
        return [ToolCall(id="c1", name="lookup_customer", arguments={"customer_id": "cu-1"})]
    if done == 1:
        return [ToolCall(id="c2", name="last_contact", arguments={"customer_id": "cu-1"})]
    return "All set."


@pytest.fixture(autouse=True)
def _reset() -> None:
    ran.clear()


# -- the redactor ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("4111111111111111", "card"),
        ("4111 1111 1111 1111", "card"),
        ("5555-5555-5555-4444", "card"),
        ("378282246310005", "card"),  # 15-digit Amex
        # Fullwidth digits read the same.
        ("4111 1111 1111 1111".translate({48 + d: 0xFF10 + d for d in range(10)}), "card"),
        ("ana.lopez+billing@mail.example.co.uk", "email"),
        ("josé.müller@example.com", "email"),  # letters of any script, as the name has them
        ("ana@bücher.de", "email"),
        ("DE89 3704 0044 0532 0130 00", "iban"),
        ("GB82WEST12345698765432", "iban"),
    ],
)
def test_personal_data_shapes_are_redacted_inside_text(text: str, kind: str) -> None:
    out = Redactor().text(f"customer: {text}.")
    assert out == f"customer: [REDACTED:{kind}]."


@pytest.mark.parametrize(
    "text",
    [
        "order 4111111111111112 shipped",  # fails the Luhn check
        "DE89 3704 0044 0532 0130 01",  # fails the IBAN checksum
        "timestamp 1733050000000 and id 00000000000000",
        "an @ sign, user@localhost and v1.2.3",
    ],
)
def test_lookalikes_are_left_alone(text: str) -> None:
    assert Redactor().text(text) == text


def test_card_numbers_as_json_numbers_and_the_pii_switches() -> None:
    value = {"card": 4111111111111111, "count": 4111, "note": f"mail {EMAIL}"}
    assert Redactor().value(value) == {
        "card": "[REDACTED:card]",
        "count": 4111,
        "note": "mail [REDACTED:email]",
    }
    # The loop's own scrubbing (pii=False) and a redactor built with pii=False keep them.
    assert Redactor().value(value, pii=False) == value
    assert Redactor(pii=False).value(value) == value
    assert not Redactor().contains_secret(f"{EMAIL} {CARD}")  # arguments are not sealed for it


def test_settings_turn_it_off_or_extend_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOMFLOW_REDACT_PII", "false")
    monkeypatch.setenv("LOOMFLOW_REDACT_PATTERNS", '{"customer_id": "CUST-[0-9]{6}"}')
    redactor = Redactor.from_settings(Settings())
    assert redactor.text(f"CUST-123456 {EMAIL}") == f"[REDACTED:customer_id] {EMAIL}"
    monkeypatch.delenv("LOOMFLOW_REDACT_PII")
    assert Redactor.from_settings(Settings()).text(EMAIL) == "[REDACTED:email]"
    with pytest.raises(UserError, match=r"'bad'.*not a valid regex"):
        Redactor(pii_patterns={"bad": "(unclosed"})


# -- sealing --------------------------------------------------------------------------------


def test_a_sensitive_result_is_sealed_and_only_the_model_request_is_unsealed() -> None:
    sealer = Sealer({"lookup_customer": lookup_customer, "last_contact": last_contact})
    real = ToolOutcome(ok=True, value={"card": CARD})
    sealed = sealer.seal_result("lookup_customer", real)
    assert isinstance(sealed.value, str)
    assert sealed.value.startswith("[sealed-result:")
    assert sealer.seal_result("lookup_customer", sealed) == sealed  # sealing twice is a no-op
    assert sealer.seal_result("last_contact", real) is real  # not declared: untouched
    failed = ToolOutcome(ok=False, error="no such customer", error_type="tool_error")
    assert sealer.seal_result("lookup_customer", failed) is failed
    transcript = [Message.user("hi"), Message.tool_result("c1", sealed.as_text())]
    assert sealer.unseal_messages(transcript)[1].content == real.as_text()
    assert transcript[1].content == sealed.value  # the kept transcript is not changed
    # Another process (a resumed run) does not have the value: the model is told so.
    assert Sealer({}).unseal_messages(transcript)[1].content == SEALED_RESULT_LOST
    assert repr(lookup_customer) == "Tool(name='lookup_customer', sensitive_result=True)"


# -- every store of a real run --------------------------------------------------------------


def _sqlite_rows(path: Path) -> dict[str, str]:
    con = sqlite3.connect(path)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {t: "\n".join(map(repr, con.execute(f'SELECT * FROM "{t}"'))) for t in tables}
    finally:
        con.close()


async def _postgres_rows(dsn: str) -> dict[str, str]:
    import asyncpg

    con = await asyncpg.connect(dsn)
    try:
        tables = [
            r["tablename"]
            for r in await con.fetch("SELECT tablename FROM pg_tables WHERE schemaname='public'")
        ]
        out = {}
        for t in tables:
            rows = await con.fetch(f'SELECT * FROM "{t}"')
            # bytea columns (journal values) are searched as the text they hold.
            out[t] = "\n".join(
                " ".join(
                    v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                    for v in r.values()
                )
                for r in rows
            )
        return out
    finally:
        await con.close()


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_no_store_holds_a_sealed_result_and_the_audit_log_holds_no_pii(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = tmp_path / "app.db"
    url = request.getfixturevalue("pg_dsn") if backend == "postgres" else f"sqlite:///{path}"
    runtime = runtime_from_url(url)
    model = FunctionModel(plan)
    agent = Agent(
        "You help customers.",
        model=model,
        tools=[lookup_customer, last_contact],
        runtime=runtime,
        memory=memory_for(runtime),
        audit=AuditLog(audit_store_beside(runtime.database)),
        tuning=Tuning(checkpoint=True),
    )
    result = await agent.run("What card is on file?", session_id="s-1", user_id="ana")
    await runtime.close()
    assert result.output == "All set."
    # The model read the real values in the live run.
    seen = model.requests[1][-1].content
    assert CARD in seen
    assert EMAIL in seen
    assert ADDRESS in seen

    rows = _sqlite_rows(path) if backend == "sqlite" else await _postgres_rows(url)
    everything = "\n".join(rows.values())
    for value in SEALED_VALUES:
        assert value not in everything, f"{value!r} stored in clear"
    audit = "\n".join(text for table, text in rows.items() if "audit" in table)
    for value in REDACTED_VALUES:
        assert value not in audit, f"{value!r} in the audit log"
    assert "[REDACTED:email]" in audit
    assert "[REDACTED:card]" in audit
    # The sealed form is what every store kept (so the searches above looked at real rows).
    for table in ("loom_entries", "loom_checkpoints", "loom_memory_episodes", "loom_audit"):
        assert "[sealed-result:" in rows[table], f"{table} does not hold the sealed result"
    if backend == "sqlite":  # nor in any page SQLite left in the WAL or elsewhere on disk
        for file in tmp_path.iterdir():  # noqa: ASYNC240 - the run is over; nothing to block
            raw = file.read_bytes()
            for value in SEALED_VALUES:
                assert value.encode() not in raw, f"{value!r} in {file.name}"


async def test_a_replay_matches_the_sealed_transcript_and_a_restart_tells_the_model(
    tmp_path: Path,
) -> None:
    class Crash(BaseException):
        pass

    crash = [True]

    def flaky(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool" and messages[-1].name == "last_contact" and crash:
            crash.pop()
            raise Crash  # the process "dies" with the sealed result journaled
        return plan(messages, tools)

    def agent(model: FunctionModel) -> Agent:
        # A new Agent stands for a new process: its sealers never saw the first run's values.
        runtime = SqliteRuntime(tmp_path / "journal.db")
        return Agent("x", model=model, tools=[lookup_customer, last_contact], runtime=runtime)

    first = agent(FunctionModel(flaky))
    with pytest.raises(Crash):
        await first.run("card?", session_id="s", user_id="ana")
    await first.runtime.close()  # type: ignore[union-attr]

    second_model = FunctionModel(flaky)
    second = agent(second_model)
    result = await second.resume("card?", session_id="s", user_id="ana")
    assert ran == ["cu-1"]  # the lookup replayed from the journal
    # Both earlier model calls replayed (their fingerprints are over the sealed transcript);
    # the live one reads a note in place of the value the dead run sealed.
    assert second_model.calls == 1
    assert (result.replayed_steps, result.fresh_steps) == (4, 2)  # the live call, the episode
    lookup_result = next(m for m in second_model.requests[0] if m.name == "lookup_customer")
    assert lookup_result.content == SEALED_RESULT_LOST
    assert CARD not in str(result.messages)
    await second.runtime.close()  # type: ignore[union-attr]

    # A run that completes in one process replays in full in another: no divergence.
    third_model = FunctionModel(plan)
    third = agent(third_model)
    again = await third.resume("card?", session_id="s", user_id="ana")
    assert third_model.calls == 0
    assert again.fresh_steps == 0
    await third.runtime.close()  # type: ignore[union-attr]


async def test_a_run_resumed_by_the_same_agent_gives_the_model_the_real_value() -> None:
    class Crash(BaseException):
        pass

    crash = [True]

    def flaky(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool" and crash:
            crash.pop()
            raise Crash  # e.g. a store outage: the run fails, and the app resumes it
        return plan(messages, tools)

    model = FunctionModel(flaky)
    agent = Agent(
        "x", model=model, tools=[lookup_customer, last_contact], runtime=InMemoryRuntime()
    )
    with pytest.raises(Crash):
        await agent.run("card?", session_id="s", user_id="ana")
    result = await agent.resume("card?", session_id="s", user_id="ana")
    assert ran == ["cu-1"]  # replayed from the journal, sealed there
    lookup_result = next(m for m in model.requests[-2] if m.name == "lookup_customer")
    assert CARD in lookup_result.content
    assert CARD not in str(result.messages)


async def test_the_audit_log_of_a_sensitive_tool_shows_the_placeholder() -> None:
    store = InMemoryAuditStore()
    agent = Agent(
        "x",
        model=FunctionModel(plan),
        tools=[lookup_customer, last_contact],
        runtime=InMemoryRuntime(),
        audit=AuditLog(store),
    )
    result = await agent.run("card?", session_id="s", user_id="ana")
    results = [e.payload for e in store.all_entries if e.action == "tool.result"]
    assert str(results[0]["result"]).startswith("[sealed-result:")
    assert results[1]["result"] == "wrote from [REDACTED:email], paid with [REDACTED:card]"
    # Events and the run's transcript carry the sealed form too.
    assert CARD not in str(result.messages)


async def test_spans_with_content_capture_do_not_show_a_sealed_result() -> None:
    from loomflow.telemetry import Telemetry
    from loomflow.telemetry.testing import SpanCapture

    capture = SpanCapture()
    telemetry = Telemetry(tracer_provider=capture.provider, metrics=False, capture_content=True)
    agent = Agent(
        "x",
        model=FunctionModel(plan),
        tools=[lookup_customer, last_contact],
        runtime=InMemoryRuntime(),
        telemetry=telemetry,
    )
    await agent.run("card?", session_id="s", user_id="ana")
    text = "\n".join(f"{s.name} {dict(s.attributes or {})} {s.events}" for s in capture.spans)
    assert "last_contact" in text  # content was captured
    for value in (*SEALED_VALUES, *REDACTED_VALUES):
        assert value not in text
