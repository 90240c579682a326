"""Guardrails: PII and regex detection; block or redact input, output and live tool results."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from loomflow.agent import Agent, RunFinished, Tuning
from loomflow.audit import AuditLog, InMemoryAuditStore
from loomflow.errors import UserError
from loomflow.governance import GuardrailTripped, PIIGuardrail, RegexGuardrail
from loomflow.governance.guardrails import luhn_valid
from loomflow.memory import memory_for
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel, ScriptedModel
from loomflow.runtime import InMemoryRuntime, SqliteRuntime
from loomflow.tools import tool

EMAIL = "jane.doe+billing@example.co.uk"
CARD = "4111 1111 1111 1111"
KEY = "sk-ant-api03-" + "x" * 40


FULLWIDTH = str.maketrans("0123456789", "".join(map(chr, range(0xFF10, 0xFF1A))))
ARABIC_INDIC = str.maketrans("0123456789", "".join(map(chr, range(0x0660, 0x066A))))


@pytest.mark.parametrize(
    ("text", "kinds"),
    [
        (f"write to {EMAIL} today", ["email"]),
        (f"card {CARD} exp 12/29", ["card"]),
        ("card 4111-1111-1111-1111", ["card"]),
        ("amex 378282246310005", ["card"]),
        (f"key {KEY}", ["api_key"]),
        ("openai sk-proj-" + "A1b2" * 8, ["api_key"]),
        ("aws AKIAIOSFODNN7EXAMPLE here", ["api_key"]),
        ("gh ghp_" + "a" * 36, ["api_key"]),
        ("slack xoxb-1234567890-abcdefghij", ["api_key"]),
        ("google AIza" + "B" * 35, ["api_key"]),
        ("stripe sk_live_" + "c" * 24, ["api_key"]),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIE...", ["api_key"]),
        # An accented letter anywhere in the address hid all of it (an ASCII-only pattern).
        ("write to josé@example.com", ["email"]),
        ("write to info@bücher.de", ["email"]),
        # Digits of another script spell the same card number to a reader.
        ("card " + "4111 1111 1111 1111".translate(FULLWIDTH), ["card"]),
        ("card " + "4111111111111111".translate(ARABIC_INDIC), ["card"]),
    ],
)
def test_pii_is_found(text: str, kinds: list[str]) -> None:
    assert [f.kind for f in PIIGuardrail().find(text)] == kinds


@pytest.mark.parametrize(
    "text",
    [
        "card 4111 1111 1111 1112",  # fails the Luhn check
        "order 1234567890123",  # 13 digits, not a card
        "call +1 415 555 0100 on 2026-05-08",
        "0000 0000 0000 0000",  # passes Luhn, but a placeholder
        "12345678901234567890123",  # longer than any card
        "the sk-short key and user@localhost",
        "version 1.2.3, port 8080, total 4111",
    ],
)
def test_ordinary_text_is_not_pii(text: str) -> None:
    assert PIIGuardrail().find(text) == []


def test_luhn() -> None:
    assert luhn_valid("79927398713")
    assert not luhn_valid("79927398710")
    assert not luhn_valid("4111x")


def test_redaction_merges_overlaps_and_keeps_the_rest() -> None:
    guard = RegexGuardrail("secret", {"word": r"top secret", "top": r"top"}, action="redact")
    assert guard.redact("a top secret plan, top") == ("a [REDACTED:word] plan, [REDACTED:top]")
    assert PIIGuardrail(kinds=("email",)).redact(f"{EMAIL} and {CARD}") == (
        f"[REDACTED:email] and {CARD}"
    )


def test_bad_guardrails_are_refused() -> None:
    with pytest.raises(UserError, match="name"):
        RegexGuardrail("has spaces", "x")
    with pytest.raises(UserError, match="bad pattern"):
        RegexGuardrail("broken", "(unclosed")
    with pytest.raises(UserError, match="stages"):
        PIIGuardrail(stages=("everywhere",))  # type: ignore[arg-type]
    with pytest.raises(UserError, match="collection"):
        PIIGuardrail(stages="input")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="PII kinds"):
        PIIGuardrail(kinds=("ssn",))
    with pytest.raises(UserError, match="action"):
        PIIGuardrail(action="warn")  # type: ignore[arg-type]


async def events_of(agent: Agent, prompt: str, **kwargs: Any) -> tuple[Any, list[Any]]:
    events = [e async for e in agent.stream(prompt, **kwargs)]
    assert isinstance(events[-1], RunFinished)
    return events[-1].result, events


def tripped(events: list[Any]) -> list[GuardrailTripped]:
    return [e for e in events if isinstance(e, GuardrailTripped)]


async def test_a_blocked_prompt_never_reaches_the_model() -> None:
    model = ScriptedModel(["hi"])
    agent = Agent("x", model=model, guardrails=[PIIGuardrail(action="block")])
    result, events = await events_of(agent, f"my card is {CARD}, mail {EMAIL}")
    assert (result.interrupted, result.interruption_reason) == (True, "guardrail:pii")
    assert model.calls == 0
    [event] = tripped(events)
    assert (event.stage, event.action, event.detail) == ("input", "block", "1 card, 1 email")
    # The event says what was found, never the text itself.
    assert CARD not in json.dumps(event.model_dump())
    assert EMAIL not in event.detail


async def test_a_redacted_prompt_is_what_the_model_sees() -> None:
    model = ScriptedModel(["noted"])
    agent = Agent("x", model=model, guardrails=[PIIGuardrail()])
    result, events = await events_of(agent, f"reach me at {EMAIL}")
    assert not result.interrupted
    assert model.requests[0][-1].content == "reach me at [REDACTED:email]"
    assert [(e.stage, e.action) for e in tripped(events)] == [("input", "redact")]


async def test_an_output_guardrail_blocks_or_redacts_the_answer() -> None:
    leak = f"the key is {KEY}"
    blocked = await Agent(
        "x", model=ScriptedModel([leak]), guardrails=[PIIGuardrail("keys", action="block")]
    ).run("go")
    assert blocked.interruption_reason == "guardrail:keys"
    redacted = await Agent(
        "x", model=ScriptedModel([leak]), guardrails=[PIIGuardrail(stages=("output",))]
    ).run("go")
    assert redacted.output == "the key is [REDACTED:api_key]"
    assert not redacted.interrupted


class Payment(BaseModel):
    email: str
    card: int | str


async def test_a_redacted_structured_answer_is_still_json() -> None:
    answer = json.dumps({"email": EMAIL, "card": 4111111111111111})
    agent = Agent(
        "x",
        model=FunctionModel(lambda messages, tools: answer),
        output_type=Payment,
        guardrails=[PIIGuardrail()],
    )
    # The card number, a JSON number, became a bare [REDACTED:card]: the answer was no longer
    # JSON and the run failed with an OutputValidationError instead of going on.
    result = await agent.run("pay")
    assert result.parsed == Payment(email="[REDACTED:email]", card="[REDACTED:card]")
    assert json.loads(result.output) == {"email": "[REDACTED:email]", "card": "[REDACTED:card]"}
    assert result.messages[-1].content == result.output
    # A pattern across JSON syntax matches no single value: the text's redaction stands.
    spanning = RegexGuardrail("card_field", r'"card": \d+', action="redact")
    agent = Agent("x", model=FunctionModel(lambda messages, tools: answer), guardrails=[spanning])
    result = await agent.run("pay")
    assert "4111111111111111" not in result.output
    assert "[REDACTED:card_field]" in result.output


async def test_a_redacted_structured_answer_in_a_code_fence_is_still_json() -> None:
    """Models without native structured output often fence their JSON, which is accepted: a
    redaction that would break it is made value by value there too."""
    answer = "```json\n" + json.dumps({"email": EMAIL, "card": 4111111111111111}) + "\n```"
    agent = Agent(
        "x",
        model=FunctionModel(lambda messages, tools: answer),
        output_type=Payment,
        output_retries=0,
        guardrails=[PIIGuardrail()],
    )
    result = await agent.run("pay")
    assert result.parsed == Payment(email="[REDACTED:email]", card="[REDACTED:card]")
    assert "4111111111111111" not in result.output


async def test_a_redacted_answer_is_what_the_transcript_and_snapshot_keep() -> None:
    runtime = InMemoryRuntime()
    answer = f"Mail {EMAIL} for help."
    agent = Agent(
        "x",
        model=ScriptedModel([answer]),
        runtime=runtime,
        guardrails=[PIIGuardrail(stages=("output",))],
        tuning=Tuning(checkpoint=True),
    )
    result = await agent.run("hi", session_id="s", user_id="u")
    assert result.output == "Mail [REDACTED:email] for help."
    assert result.messages[-1].content == result.output
    [snapshot] = await agent.list_checkpoints("s", user_id="u")
    assert snapshot.final
    assert (snapshot.output, snapshot.messages[-1].content) == (result.output, result.output)
    [episode] = await memory_for(runtime).episodes("s", user_id="u")
    assert EMAIL not in json.dumps([m.model_dump() for m in episode.messages])
    # A resume restores the snapshot and checks the answer again: same result, no model call.
    resumed = await agent.resume("hi", session_id="s", user_id="u")
    assert (resumed.output, resumed.messages[-1].content) == (result.output, result.output)


async def test_a_blocked_answer_is_kept_by_no_snapshot() -> None:
    runtime = InMemoryRuntime()
    model = ScriptedModel([f"the key is {KEY}"])
    agent = Agent(
        "x",
        model=model,
        runtime=runtime,
        guardrails=[PIIGuardrail("keys", action="block")],
        tuning=Tuning(checkpoint=True),
    )
    result = await agent.run("hi", session_id="s", user_id="u")
    assert result.interruption_reason == "guardrail:keys"
    assert KEY not in json.dumps([m.model_dump() for m in result.messages])
    snapshots = await agent.list_checkpoints("s", user_id="u")
    assert not any(KEY in json.dumps(c.model_dump(mode="json")) for c in snapshots)
    # Resumed, the journaled answer replays (no model call) and is blocked again.
    resumed = await agent.resume("hi", session_id="s", user_id="u")
    assert resumed.interruption_reason == "guardrail:keys"
    assert model.calls == 1


async def test_an_output_finding_is_audited_before_the_run_ends() -> None:
    audit = AuditLog(InMemoryAuditStore())
    agent = Agent(
        "x",
        model=ScriptedModel([f"mail {EMAIL}"]),
        guardrails=[PIIGuardrail(action="redact", stages=("output",))],
        audit=audit,
    )
    await agent.run("hi", session_id="s", user_id="u")
    actions = [e.action for e in (await audit.query(user_id="u")).entries]
    assert actions.index("guardrail.trip") < actions.index("run.end")
    assert actions[-1] == "run.end"


async def test_a_failed_audit_write_at_the_end_still_tells_every_hook() -> None:
    """The output finding reaches the hooks just before the run's end; if the audit log
    cannot write it, the run raises, and every hook still hears that the run ended."""
    from loomflow.hooks import RunHooks

    ended: list[BaseException | None] = []

    class Seen(RunHooks):
        async def run_finished(self, info: Any, result: Any, error: BaseException | None) -> None:
            ended.append(error)

    store = InMemoryAuditStore()
    # The audit log writes the loop's entries through the store's trusted path (_write), not
    # append(), which refuses reserved actions for application code: the outage goes there.
    write = store._write

    async def flaky(records: Any) -> Any:
        if any(r.action == "guardrail.trip" for r in records):
            raise OSError("audit database unreachable")
        return await write(records)

    store._write = flaky  # type: ignore[method-assign]
    audit = AuditLog(store)
    agent = Agent(
        "x",
        model=ScriptedModel([f"mail {EMAIL}"]),
        guardrails=[PIIGuardrail(action="redact", stages=("output",))],
        audit=audit,
        hooks=[Seen()],
    )
    with pytest.raises(OSError, match="unreachable"):
        await agent.run("hi", session_id="s", user_id="u")
    assert len(ended) == 1
    assert isinstance(ended[0], OSError)
    assert audit.as_hooks()._runs == {}  # the audit hooks forgot the run too


@tool
def customer(customer_id: str) -> dict[str, Any]:
    """Fetch a customer record."""
    return {"id": customer_id, "email": EMAIL, "card": 4111111111111111, "tier": "gold"}


def fetch_then_answer(messages: list[Message], tools: list[ToolSpec]) -> Any:
    results = [m for m in messages if m.role == "tool"]
    if not results:
        return [ToolCall(id="c1", name="customer", arguments={"customer_id": "42"})]
    return f"record: {results[0].content}"


async def test_tool_results_are_redacted_before_the_journal_keeps_them() -> None:
    runtime = InMemoryRuntime()
    guarded = Agent(
        "x",
        model=FunctionModel(fetch_then_answer),
        tools=[customer],
        guardrails=[PIIGuardrail(stages=("tool_result",))],
        runtime=runtime,
    )
    result, events = await events_of(guarded, "go", session_id="s")
    assert EMAIL not in result.output
    assert "4111111111111111" not in result.output
    assert '"email":"[REDACTED:email]"' in result.output
    assert '"card":"[REDACTED:card]"' in result.output
    assert '"tier":"gold"' in result.output
    [event] = tripped(events)
    assert (event.stage, event.detail) == ("tool_result", "1 card, 1 email")
    # Resumed without any guardrail, the journal hands back the redacted value.
    bare = Agent("x", model=FunctionModel(fetch_then_answer), tools=[customer], runtime=runtime)
    replayed = await bare.resume("go", session_id="s")
    assert replayed.replayed_steps == 4  # two model calls, the tool call, the episode write
    assert replayed.output == result.output
    # The episode memory keeps beside the journal holds the redacted result too.
    [episode] = await memory_for(runtime).episodes("s", user_id=None)
    stored = json.dumps([m.model_dump() for m in episode.messages])
    assert "[REDACTED:email]" in stored
    assert EMAIL not in stored


@dataclasses.dataclass
class Contact:
    name: str
    email: str


@pytest.mark.parametrize(
    "value",
    [
        {EMAIL: {"orders": 3}},  # a result keyed by e-mail address
        [{"by_card": {4111111111111111: "gold"}}],
        {EMAIL, "other"},
        frozenset({EMAIL}),
        Contact("Bob", EMAIL),
        EMAIL.encode(),
    ],
    ids=["key", "number_key", "set", "frozenset", "dataclass", "bytes"],
)
async def test_every_shape_of_tool_result_is_scanned(tmp_path: Path, value: Any) -> None:
    @tool
    def lookup() -> Any:
        """Look something up."""
        return value

    def fetch(messages: list[Message], tools: list[ToolSpec]) -> Any:
        results = [m for m in messages if m.role == "tool"]
        if not results:
            return [ToolCall(id="c1", name="lookup", arguments={})]
        return f"seen: {results[0].content}"

    # Dict keys, sets, dataclasses and bytes reached the model (and the journal) unscanned.
    async with SqliteRuntime(tmp_path / "journal.db") as runtime:
        agent = Agent(
            "x", model=FunctionModel(fetch), tools=[lookup], guardrails=[PIIGuardrail()],
            runtime=runtime,
        )  # fmt: skip
        result, events = await events_of(agent, "go", session_id="s")
        assert "[REDACTED:" in result.output
        assert EMAIL not in result.output
        assert "4111111111111111" not in result.output
        assert [e.stage for e in tripped(events)] == ["tool_result"]
        entries = await runtime.entries("s", None)
    journal = (tmp_path / "journal.db").read_bytes()
    assert EMAIL.encode() not in journal
    assert b"4111111111111111" not in journal
    assert any(e.name.startswith("tool_call") for e in entries)  # journaled, redacted


async def test_a_blocked_tool_result_ends_the_run_and_is_not_journaled() -> None:
    runtime = InMemoryRuntime()
    agent = Agent(
        "x",
        model=FunctionModel(fetch_then_answer),
        tools=[customer],
        guardrails=[RegexGuardrail("no_email", r"@example\.", action="block")],
        runtime=runtime,
    )
    result, events = await events_of(agent, "go", session_id="s")
    assert result.interruption_reason == "guardrail:no_email"
    assert [(e.name, e.stage) for e in tripped(events)] == [("no_email", "tool_result")]
    entries = await runtime.entries("s", None)
    assert [e.name for e in entries] == ["model_call_0", "persist_episode_0"]
    # The run's episode keeps the prompt only: the tool request whose result was blocked is
    # dropped with it.
    [episode] = await memory_for(runtime).episodes("s", user_id=None)
    assert [m.role for m in episode.messages] == ["user"]


async def test_stages_limit_where_a_guardrail_looks() -> None:
    model = ScriptedModel([f"sure, {EMAIL}"])
    agent = Agent("x", model=model, guardrails=[PIIGuardrail(stages=("input",))])
    result = await agent.run(f"from {EMAIL}")
    assert result.output == f"sure, {EMAIL}"
    assert "[REDACTED:email]" in model.requests[0][-1].content


async def test_input_guardrails_scan_the_history_given_with_the_prompt() -> None:
    """What an input guardrail stops in a prompt, it stops in the messages given before it:
    their text and their tool calls' arguments, whatever the role."""
    history = [
        Message.user(f"I am {EMAIL}"),
        Message.assistant("noted", [ToolCall(id="c", name="save", arguments={"card": CARD})]),
        Message.tool_result("c", "saved"),
        Message.assistant("anything else?"),
    ]
    model = ScriptedModel([], default="hi")
    agent = Agent("x", model=model, guardrails=[PIIGuardrail(action="block")])
    result = await Agent._drain(
        agent._events("hello", None, None, None, resume=False, history=history)
    )
    assert (result.interrupted, result.interruption_reason) == (True, "guardrail:pii")
    assert model.calls == 0

    model = ScriptedModel([], default="hi")
    agent = Agent("x", model=model, guardrails=[PIIGuardrail()])
    events = [
        e async for e in agent._events("hello", None, None, None, resume=False, history=history)
    ]
    assert not events[-1].result.interrupted
    seen = json.dumps([m.model_dump(mode="json") for m in model.requests[0]])
    assert EMAIL not in seen
    assert CARD not in seen
    assert "I am [REDACTED:email]" in seen
    assert [(e.stage, e.detail) for e in tripped(events)] == [("input", "1 card, 1 email")]
    # An output-only guardrail leaves the history alone.
    model = ScriptedModel([], default="hi")
    agent = Agent("x", model=model, guardrails=[PIIGuardrail(stages=("output",))])
    await Agent._drain(agent._events("hello", None, None, None, resume=False, history=history))
    assert EMAIL in model.requests[0][1].content


async def test_a_team_worker_never_sees_an_earlier_task_unredacted_and_still_replays(
    tmp_path: Path,
) -> None:
    """A team worker remembers its earlier tasks as history: its input guardrail redacted
    each task as its prompt, and must redact it there too. On a resume the history is
    rebuilt and redacted the same way, so the worker's model calls replay from the journal."""

    class Crash(Exception):
        pass

    worker_seen: list[list[Message]] = []

    def worker_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        worker_seen.append(list(messages))
        return "done"

    crash = True

    def lead_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        answers = [m for m in messages if m.role == "tool"]
        if len(answers) < 2:
            task = f"bill {EMAIL}, step {len(answers)}"
            return [ToolCall(id=f"a{len(answers)}", name="ask_w", arguments={"task": task})]
        if crash:
            raise Crash
        return "all done"

    from loomflow.agent.architectures import Team

    async with SqliteRuntime(tmp_path / "journal.db") as runtime:
        worker = Agent(
            "w", model=FunctionModel(worker_decides), name="w", guardrails=[PIIGuardrail()]
        )
        lead = Agent("lead", model=FunctionModel(lead_decides), runtime=runtime, name="lead")
        team = Team(lead, [worker])
        with pytest.raises(Crash):
            await team.run("bill", session_id="s", user_id="u")
        assert len(worker_seen) == 2
        for request in worker_seen:
            assert all(EMAIL not in m.content for m in request), request
        assert [m.role for m in worker_seen[1]] == ["system", "user", "assistant", "user"]
        crash = False
        result = await team.resume("bill", session_id="s", user_id="u")
        assert result.output == "all done"
        assert len(worker_seen) == 2  # both worker calls replayed: the same redacted inputs


def test_keys_redacted_to_one_placeholder_keep_their_entries_apart() -> None:
    # A result keyed by e-mail address came back with one entry for all of them: the
    # redacted keys were equal, so each overwrote the one before (the model, the journal and
    # the audit log saw only the last customer).
    from loomflow.governance.guardrails import _map_text
    from loomflow.redaction import Redactor

    result = {"ana@example.com": {"balance": 10}, "bob@example.com": {"balance": 20}, "n": 2}
    expected = {
        "[REDACTED:email]": {"balance": 10},
        "[REDACTED:email]#2": {"balance": 20},
        "n": 2,
    }
    assert _map_text(result, PIIGuardrail().redact) == expected
    assert Redactor().value(result) == expected


def _codenames(action: str) -> RegexGuardrail:
    return RegexGuardrail(
        "codenames", {"project": r"project-falcon"}, action=action, stages=("input",)
    )


def _seen_by_model() -> tuple[FunctionModel, list[str]]:
    """A model that names the codename the first time and records what it was sent."""
    sent: list[str] = []

    def decide(messages: list[Message], tools: list[ToolSpec]) -> str:
        sent.append(" ".join(m.content for m in messages))
        return "it is project-falcon" if len(sent) == 1 else "ok"

    return FunctionModel(decide), sent


async def test_recalled_episodes_pass_the_input_guardrails(tmp_path: Path) -> None:
    # The first run's answer names the codename (only the input is checked), so its episode
    # holds it; the second run is reminded of it, and the guardrail sees that reminder.
    runtime = SqliteRuntime(tmp_path / "j.db")
    model, sent = _seen_by_model()
    agent = Agent("x", model=model, runtime=runtime, guardrails=[_codenames("redact")])
    await agent.run("what is it called?", session_id="s", user_id="u")
    events = [e async for e in agent.stream("and again?", session_id="s", user_id="u")]
    assert "project-falcon" not in sent[1]
    assert "[REDACTED:project]" in sent[1]
    tripped = [e for e in events if isinstance(e, GuardrailTripped)]
    assert [(e.stage, e.detail) for e in tripped] == [("input", "1 project")]
    # The stored episode is unchanged: what a run keeps is its own turns.
    assert agent.memory is not None
    episodes = await agent.memory.episodes("s", user_id="u")
    assert "project-falcon" in episodes[0].messages[-1].content
    replay = await agent.resume("and again?", session_id="s", user_id="u")
    assert replay.fresh_steps == 0  # the same recall, redacted the same way, replays
    await runtime.close()


async def test_a_blocking_input_guardrail_stops_a_run_reminded_of_what_it_blocks(
    tmp_path: Path,
) -> None:
    runtime = SqliteRuntime(tmp_path / "j.db")
    model, sent = _seen_by_model()
    await Agent("x", model=model, runtime=runtime).run("name it", session_id="s", user_id="u")
    agent = Agent("x", model=model, runtime=runtime, guardrails=[_codenames("block")])
    result = await agent.run("go on", session_id="s", user_id="u")
    assert (result.interrupted, result.interruption_reason) == (True, "guardrail:codenames")
    assert len(sent) == 1  # the second run never reached the model
    await runtime.close()
