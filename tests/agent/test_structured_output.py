"""Structured output with scripted models: validation, retries, the journal, crashes."""

from __future__ import annotations

import datetime
import decimal
import json
import math
import pickle
import selectors
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field, RootModel

from loomflow.agent import Agent, ModelDeltaEvent, RunFinished, Tuning
from loomflow.agent._output import StructuredOutput
from loomflow.errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    OutputValidationError,
    ReplayDivergenceError,
)
from loomflow.memory import InMemoryMemory
from loomflow.messages import (
    Message,
    ModelResponse,
    ModelSettings,
    OutputFormat,
    ToolCall,
    ToolSpec,
)
from loomflow.models import FunctionModel, OpenAIModel, ScriptedModel
from loomflow.runtime import JournalRuntime, SqliteRuntime
from loomflow.runtime._store import fingerprint
from loomflow.testing.providers import FakeOpenAIAPI, Reply
from loomflow.tools import tool

WORKER = Path(__file__).with_name("_structured_worker.py")


class Weather(BaseModel):
    """Today's weather in one city."""

    city: str
    temp_c: float


class Forecast(BaseModel):
    days: list[Weather]
    note: str | None = None  # optional: no strict form


GOOD = '{"city": "Oslo", "temp_c": 3.5}'


def _agent(model: object, **options: object) -> Agent:
    options.setdefault("memory", False)
    return Agent("weather bot", model=model, telemetry=False, **options)  # type: ignore[arg-type]


async def test_a_valid_answer_is_parsed_into_the_model() -> None:
    model = ScriptedModel([GOOD])
    result = await _agent(model).run("weather in Oslo?", output_type=Weather)
    assert isinstance(result.parsed, Weather)
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)
    assert result.output == GOOD
    assert model.calls == 1
    # A model without native structured output is told the schema in a system message.
    sent = model.requests[0]
    assert [m.role for m in sent] == ["system", "system", "user"]
    assert '"temp_c"' in sent[1].content


async def test_without_output_type_nothing_is_parsed_or_added() -> None:
    model = ScriptedModel([GOOD])
    result = await _agent(model).run("weather in Oslo?")
    assert result.parsed is None
    assert [m.role for m in model.requests[0]] == ["system", "user"]


async def test_a_fenced_answer_is_accepted() -> None:
    model = ScriptedModel([f"```json\n{GOOD}\n```"])
    result = await _agent(model).run("weather?", output_type=Weather)
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)


async def test_an_invalid_answer_is_sent_back_with_the_error_and_retried() -> None:
    model = ScriptedModel(['{"city": "Oslo"}', "not json at all", GOOD])
    result = await _agent(model).run("weather?", output_type=Weather, output_retries=2)
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)
    assert model.calls == 3
    assert result.turns == 3
    first_retry = model.requests[1][-1]
    assert first_retry.role == "user"
    assert "temp_c: Field required" in first_retry.content
    assert "Invalid JSON" in model.requests[2][-1].content
    # The transcript keeps the refused answers and the requests to fix them.
    roles = [m.role for m in result.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]


async def test_spent_retries_raise_a_typed_error_naming_the_model() -> None:
    model = ScriptedModel(['{"city": "Oslo"}', '{"city": 5, "temp_c": "warm"}'])
    with pytest.raises(OutputValidationError) as caught:
        await _agent(model).run("weather?", output_type=Weather, output_retries=1)
    error = caught.value
    assert error.output_type == "Weather"
    assert error.attempts == 2
    assert "temp_c" in error.detail
    assert "city" in error.detail
    assert error.output == '{"city": 5, "temp_c": "warm"}'
    assert "Weather" in str(error)
    assert model.calls == 2
    copy = pickle.loads(pickle.dumps(error))  # noqa: TID251 - errors cross process pools
    assert (copy.output_type, copy.attempts, copy.detail) == ("Weather", 2, error.detail)


async def test_a_refused_answer_passes_the_output_guardrails_before_it_leaves() -> None:
    # The last refused answer reached the caller in OutputValidationError.output without
    # the output guardrails: an e-mail address a guardrail redacts or blocks in any answer.
    from loomflow.governance import PIIGuardrail

    leaky = '{"city": "ana@example.com"}'
    model = ScriptedModel([leaky])
    agent = _agent(model, guardrails=[PIIGuardrail(stages=("output",))])
    with pytest.raises(OutputValidationError) as caught:
        await agent.run("weather?", output_type=Weather, output_retries=0)
    assert "ana@example.com" not in caught.value.output
    assert "[REDACTED:email]" in caught.value.output
    blocking = _agent(
        ScriptedModel([leaky]), guardrails=[PIIGuardrail(action="block", stages=("output",))]
    )
    result = await blocking.run("weather?", output_type=Weather, output_retries=0)
    assert (result.interrupted, result.interruption_reason) == (True, "guardrail:pii")
    assert result.parsed is None
    assert "ana@example.com" not in result.output
    assert all("ana@example.com" not in m.content for m in result.messages)


async def test_zero_retries_raise_on_the_first_bad_answer() -> None:
    model = ScriptedModel(["{}", GOOD])
    with pytest.raises(OutputValidationError, match="after 1 attempt"):
        await _agent(model).run("weather?", output_type=Weather, output_retries=0)
    assert model.calls == 1


async def test_an_answer_cut_at_the_token_limit_is_not_retried_under_the_same_limit() -> None:
    # Asked again with the same max_tokens the model is cut again: each retry paid for a
    # whole limit's worth of output and ended in the same error.
    cut = ModelResponse(text='{"city": "Oslo", "temp', finish_reason="length")
    model = ScriptedModel([cut, GOOD])
    with pytest.raises(OutputValidationError, match="after 1 attempt") as caught:
        await _agent(model).run("weather?", output_type=Weather, output_retries=3)
    assert model.calls == 1
    assert "finish_reason 'length'" in caught.value.detail


async def test_a_filtered_answer_is_still_retried_and_a_cut_one_that_fits_is_taken() -> None:
    filtered = ModelResponse(text="I cannot", finish_reason="content_filter")
    fits = ModelResponse(text=GOOD, finish_reason="length")
    model = ScriptedModel([filtered, fits])
    result = await _agent(model).run("weather?", output_type=Weather, output_retries=1)
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)
    assert model.calls == 2


async def test_retries_count_against_max_turns() -> None:
    model = ScriptedModel(["{}", "{}", GOOD])
    result = await _agent(model, max_turns=2).run("w?", output_type=Weather, output_retries=5)
    assert result.interrupted
    assert result.interruption_reason == "max_turns"
    assert result.parsed is None
    assert model.calls == 2


async def test_tools_run_before_the_structured_answer() -> None:
    @tool
    def lookup(city: str) -> str:
        """Look the weather up."""
        return "3.5 degrees"

    model = ScriptedModel([[ToolCall(id="c1", name="lookup", arguments={"city": "Oslo"})], GOOD])
    result = await _agent(model, tools=[lookup]).run("weather?", output_type=Weather)
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)
    assert result.turns == 2


async def test_the_agent_default_applies_and_a_run_may_override_it() -> None:
    class City(BaseModel):
        city: str

    agent = _agent(ScriptedModel([GOOD, GOOD]), output_type=City)
    assert await agent.run("which city?") is not None
    default = await agent.run("which city?")
    assert default.parsed == City(city="Oslo")
    agent2 = _agent(ScriptedModel([GOOD]), output_type=City)
    override = await agent2.run("weather?", output_type=Weather)
    assert override.parsed == Weather(city="Oslo", temp_c=3.5)
    assert agent.clone().output_type is City


async def test_stream_ends_with_the_parsed_result() -> None:
    model = ScriptedModel(['{"city": "Oslo"}', GOOD])
    events = [
        event async for event in _agent(model).stream("w?", output_type=Weather, output_retries=1)
    ]
    final = events[-1]
    assert isinstance(final, RunFinished)
    assert final.result.parsed == Weather(city="Oslo", temp_c=3.5)
    deltas = [e for e in events if isinstance(e, ModelDeltaEvent)]
    assert {e.turn for e in deltas} == {0, 1}  # both attempts streamed


@pytest.mark.parametrize(
    ("output_type", "error"),
    [
        ("Weather", InvalidArgumentTypeError),
        (dict, InvalidArgumentTypeError),
        (Weather(city="x", temp_c=1), InvalidArgumentTypeError),
        (RootModel[list[int]], InvalidArgumentError),
    ],
)
async def test_a_bad_output_type_is_refused(output_type: object, error: type[Exception]) -> None:
    model = ScriptedModel([GOOD])
    with pytest.raises(error, match="output_type"):
        await _agent(model).run("w?", output_type=output_type)  # type: ignore[call-overload]
    assert model.calls == 0
    with pytest.raises(error, match="output_type"):
        _agent(model, output_type=output_type)


@pytest.mark.parametrize("retries", [-1, 1.5, True, "2"])
async def test_bad_output_retries_are_refused(retries: object) -> None:
    model = ScriptedModel([GOOD])
    with pytest.raises(InvalidArgumentError, match="output_retries"):
        await _agent(model).run("w?", output_type=Weather, output_retries=retries)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="output_retries"):
        await _agent(model).run("w?", output_retries=retries)  # type: ignore[arg-type]
    assert model.calls == 0


def test_the_format_is_strict_only_when_the_schema_has_a_strict_form() -> None:
    strict = StructuredOutput(Weather, 1).format
    assert strict.strict is True
    assert strict.json_schema["additionalProperties"] is False
    assert strict.json_schema["required"] == ["city", "temp_c"]
    assert strict.description == "Today's weather in one city."

    loose = StructuredOutput(Forecast, 1).format
    assert loose.strict is False  # note has a default: not every property is required
    assert loose.json_schema == Forecast.model_json_schema()  # sent as pydantic wrote it

    class Tags(BaseModel):
        tags: dict[str, int] = Field(description="free-form mapping")

    assert StructuredOutput(Tags, 1).format.strict is False

    class Nested(BaseModel):
        days: list[Weather]

    nested = StructuredOutput(Nested, 1).format
    assert nested.strict is True
    assert nested.json_schema["$defs"]["Weather"]["additionalProperties"] is False


class Node(BaseModel):
    """A list of numbers, one node at a time (a model with a field of its own type)."""

    value: int
    next: Node | None = None


class Tree(BaseModel):
    name: str
    children: list[Tree]  # every field required: a strict form exists


def test_a_recursive_model_is_an_object_schema_that_keeps_its_definitions() -> None:
    # Pydantic describes it as {"$defs": {"Node": ...}, "$ref": "#/$defs/Node"}: no "type".
    assert "type" not in Node.model_json_schema()
    fmt = StructuredOutput(Node, 1).format
    schema = fmt.json_schema
    assert schema["type"] == "object"
    assert "$ref" not in schema
    assert schema["required"] == ["value"]
    assert fmt.strict is False  # next has a default
    # The inner reference still resolves, against the $defs kept at the top.
    assert schema["properties"]["next"]["anyOf"][0] == {"$ref": "#/$defs/Node"}
    assert schema["$defs"]["Node"]["properties"].keys() == {"value", "next"}
    assert fmt.description.startswith("A list of numbers")

    tree = StructuredOutput(Tree, 1).format
    assert tree.strict is True
    assert tree.json_schema["additionalProperties"] is False
    assert tree.json_schema["$defs"]["Tree"]["additionalProperties"] is False
    assert tree.json_schema["properties"]["children"]["items"] == {"$ref": "#/$defs/Tree"}


async def test_a_recursive_model_is_asked_for_and_parsed() -> None:
    answer = '{"value": 1, "next": {"value": 2, "next": {"value": 3}}}'
    model = ScriptedModel(['{"value": 1, "next": {"value": "two"}}', answer])
    result = await _agent(model).run("count to 3", output_type=Node)
    assert result.parsed == Node(value=1, next=Node(value=2, next=Node(value=3)))
    assert model.calls == 2
    assert "next.value" in model.requests[1][-1].content  # the nested error was sent back
    assert '"$defs"' in model.requests[0][1].content  # the schema in the prompt resolves


class Handle:
    """Not something pydantic can write a JSON schema for."""


class Opaque(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    handle: Handle


class Undefined(BaseModel):
    later: NeverDefined  # type: ignore[name-defined]  # noqa: F821


@pytest.mark.parametrize(
    ("output_type", "reason"),
    [(Opaque, "Cannot generate a JsonSchema"), (Undefined, "not fully defined")],
)
async def test_an_output_type_without_a_json_schema_is_a_typed_error(
    output_type: type[BaseModel], reason: str
) -> None:
    model = ScriptedModel([GOOD])
    name = output_type.__name__
    with pytest.raises(
        InvalidArgumentError, match=f"output_type {name} has no JSON schema.*{reason}"
    ):
        _agent(model, output_type=output_type)
    with pytest.raises(InvalidArgumentError, match=f"output_type {name} .*{reason}"):
        await _agent(model).run("w?", output_type=output_type)
    assert model.calls == 0


class Dated(BaseModel):
    """Examples given as Python values, as pydantic validates them."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"day": datetime.date(2026, 1, 2)}]})

    day: datetime.date
    price: decimal.Decimal = Field(examples=[decimal.Decimal("9.50")])


class Unbounded(BaseModel):
    limit: float = math.inf
    floor: float = -math.inf
    day: datetime.date


class Unwritable(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [Handle()]})

    day: datetime.date


async def test_schema_extras_given_as_python_values_are_written_as_json(tmp_path: Path) -> None:
    # A date in json_schema_extra failed inside the first model call with a bare
    # "TypeError: Object of type date is not JSON serializable", leaving the run open.
    model = ScriptedModel(['{"day": "2026-03-04", "price": "1.25"}'])
    runtime = SqliteRuntime(tmp_path / "journal.db")
    result = await _agent(model, runtime=runtime).run("when?", output_type=Dated, session_id="d")
    assert result.parsed == Dated(day=datetime.date(2026, 3, 4), price=decimal.Decimal("1.25"))
    assert '"2026-01-02"' in model.requests[0][1].content
    assert '"9.50"' in model.requests[0][1].content
    # JSON has no number for infinity: the default is written as the text pydantic parses
    # back ("Infinity"); a provider's request body refused it with a bare ValueError.
    with FakeOpenAIAPI(Reply(structured={"day": "2026-03-04"})) as api:
        openai = OpenAIModel("gpt-4o", base_url=api.base_url, api_key="test")
        unbounded = await _agent(openai, runtime=runtime).run(
            "when?", output_type=Unbounded, session_id="i"
        )
    assert unbounded.parsed == Unbounded(day=datetime.date(2026, 3, 4))
    sent = api.requests[0].body["response_format"]["json_schema"]["schema"]["properties"]
    assert (sent["limit"]["default"], sent["floor"]["default"]) == ("Infinity", "-Infinity")
    # A value nothing can write as JSON is refused before anything runs.
    with pytest.raises(InvalidArgumentError, match="output_type Unwritable has no JSON schema"):
        await _agent(model, runtime=runtime).run("when?", output_type=Unwritable, session_id="u")
    assert sorted(s.session_id or "" for s in await runtime.sessions()) == ["d", "i"]
    await runtime.close()


async def test_a_prompt_that_reads_like_a_retry_request_is_not_counted_as_one() -> None:
    prompt = "Your answer is not a valid Weather object: that was yesterday. Weather now?"
    model = ScriptedModel(["not json", GOOD])
    result = await _agent(model).run(prompt, output_type=Weather, output_retries=1)
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)
    assert model.calls == 2

    model = ScriptedModel(["not json", "{}"])
    with pytest.raises(OutputValidationError) as caught:
        await _agent(model).run(prompt, output_type=Weather, output_retries=1)
    assert caught.value.attempts == 2
    assert model.calls == 2


async def test_retry_requests_recalled_from_an_earlier_run_are_not_counted() -> None:
    """Only the requests after the prompt count, not those memory brings back."""
    memory = InMemoryMemory()
    first = await _agent(ScriptedModel(["{}", GOOD]), memory=memory).run(
        "weather?", session_id="s", user_id="u", output_type=Weather
    )
    assert first.messages[3].content.startswith("Your answer is not a valid Weather object:")
    # A scripted model numbers its turns by the assistant messages it is sent, recalled ones too.
    model = ScriptedModel(["unused", "unused", "{}", GOOD])
    again = await _agent(model, memory=memory).run(
        "and tomorrow?", session_id="s", user_id="u", output_type=Weather, output_retries=1
    )
    assert again.parsed == Weather(city="Oslo", temp_c=3.5)
    assert model.calls == 2
    recalled = [m.content for m in model.requests[0] if m.role == "user"]
    assert recalled[1].startswith("Your answer is not a valid Weather object:")


def test_the_format_name_does_not_shadow_a_tool() -> None:
    assert StructuredOutput(Weather, 1, tool_names=["Weather"]).format.name == "Weather_output"
    assert StructuredOutput(Weather, 1).format.name == "Weather"


# -- the journal -----------------------------------------------------------------------------


async def test_a_replayed_run_rebuilds_parsed_without_model_calls(tmp_path: Path) -> None:
    runtime = SqliteRuntime(tmp_path / "journal.db")
    try:
        first_model = ScriptedModel(['{"city": "Oslo"}', GOOD])
        agent = _agent(first_model, runtime=runtime, output_type=Weather)
        first = await agent.run("weather?", session_id="s", user_id="u")
        assert first_model.calls == 2

        again_model = ScriptedModel(["{}", "{}"])  # would fail if it were asked at all
        again = await agent.clone(model=again_model).resume("weather?", session_id="s", user_id="u")
        assert again_model.calls == 0
        assert again.parsed == first.parsed
        assert again.parsed is not first.parsed  # validated again, not handed back
        assert again.replayed_steps >= 2
        assert again.fresh_steps == 0
    finally:
        await runtime.close()


async def test_a_resume_of_a_run_that_spent_its_retries_raises_again_for_free(
    tmp_path: Path,
) -> None:
    runtime = SqliteRuntime(tmp_path / "journal.db")
    try:
        model = ScriptedModel(["{}", "{}"])
        agent = _agent(model, runtime=runtime, output_type=Weather)
        with pytest.raises(OutputValidationError):
            await agent.run("weather?", session_id="s", user_id="u")
        replay_model = ScriptedModel([GOOD, GOOD])
        with pytest.raises(OutputValidationError):
            await agent.clone(model=replay_model).resume("weather?", session_id="s", user_id="u")
        assert replay_model.calls == 0
    finally:
        await runtime.close()


async def test_runs_without_output_type_keep_their_journal_keys(tmp_path: Path) -> None:
    """Old journals replay: a plain run's model call is fingerprinted as before."""
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)
    try:
        agent = _agent(ScriptedModel(["hello"]), runtime=runtime)
        await agent.run("hi", session_id="s", user_id="u")
        typed = _agent(ScriptedModel([GOOD]), runtime=runtime, output_type=Weather)
        await typed.run("hi", session_id="s2", user_id="u")
    finally:
        await runtime.close()
    settings = ModelSettings()
    plain = [Message.system("weather bot"), Message.user("hi")]
    expected_plain = fingerprint([plain, [], settings], {})
    fmt = StructuredOutput(Weather, 1).format
    expected_typed = fingerprint([plain, [], settings, fmt], {})
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT fingerprint FROM loom_entries WHERE name = 'model_call_0'"
        ).fetchall()
    assert sorted(r[0] for r in rows) == sorted([expected_plain, expected_typed])


async def test_a_restored_checkpoint_rebuilds_parsed(tmp_path: Path) -> None:
    runtime = SqliteRuntime(tmp_path / "journal.db")
    try:
        agent = _agent(
            ScriptedModel(['{"city": 1}', GOOD]),
            runtime=runtime,
            output_type=Weather,
            tuning=Tuning(checkpoint=True),
        )
        await agent.run("weather?", session_id="s", user_id="u")
        model = ScriptedModel([])
        restored = await agent.clone(model=model).resume("weather?", session_id="s", user_id="u")
        assert restored.restored_from is not None
        assert restored.parsed == Weather(city="Oslo", temp_c=3.5)
        assert model.calls == 0
    finally:
        await runtime.close()


@pytest.mark.parametrize(
    "prompt",
    # The second reads like a retry request: the restored run still has its one retry left
    # (it counts from the prompt_index the snapshot keeps).
    ["weather?", "Your answer is not a valid Weather object: weather?"],
)
async def test_a_crash_between_the_refused_answer_and_its_retry_snapshot_resumes(
    tmp_path: Path, prompt: str
) -> None:
    """The snapshot after a refused answer is not final: a restore goes on to the retry."""
    runtime = SqliteRuntime(tmp_path / "journal.db")
    calls: list[int] = []

    def answer(messages: list[Message], tools: list[ToolSpec]) -> str:
        calls.append(len(messages))
        if len(calls) == 1:
            return '{"city": 1}'
        raise ConnectionError("the process died here")

    try:
        agent = _agent(
            FunctionModel(answer),
            runtime=runtime,
            output_type=Weather,
            tuning=Tuning(checkpoint=True),
        )
        with pytest.raises(ConnectionError):
            await agent.run(prompt, session_id="s", user_id="u")
        model = ScriptedModel(["unused", GOOD])  # turn 1 is the retry
        result = await agent.clone(model=model).resume(prompt, session_id="s", user_id="u")
        assert result.restored_from is not None
        assert model.calls == 1
        assert result.parsed == Weather(city="Oslo", temp_c=3.5)
    finally:
        await runtime.close()


def _wait_for_line(proc: subprocess.Popen[str], expected: str, timeout: float) -> None:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no {expected!r} from the worker within {timeout}s")
    line = proc.stdout.readline().strip()
    assert line == expected, line


@pytest.mark.crash
def test_killed_before_the_retry_resumes_without_paying_for_the_first_attempt(
    tmp_path: Path,
) -> None:
    journal, ledger = tmp_path / "journal.db", tmp_path / "ledger.txt"
    first = subprocess.Popen(
        [sys.executable, str(WORKER), str(journal), str(ledger), "first"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_line(first, "RETRYING", timeout=60)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
    assert first.returncode == -signal.SIGKILL
    assert ledger.read_text().splitlines() == ["first first-attempt", "first retry"]

    resumed = subprocess.run(
        [sys.executable, str(WORKER), str(journal), str(ledger), "resume"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    # The refused first answer replayed from the journal; only the retry was asked for.
    assert ledger.read_text().splitlines() == [
        "first first-attempt",
        "first retry",
        "resume retry",
    ]
    assert summary["model_calls"] == 1
    assert summary["parsed"] == {"vendor": "ACME", "items": 3, "total_eur": 59.0}
    assert summary["turns"] == 2
    assert summary["replayed"] >= 1
    assert len(summary["feedback"]) == 2
    assert "items" in summary["feedback"][1]


def test_the_output_format_is_a_journal_value() -> None:
    from loomflow.runtime import codec

    fmt = StructuredOutput(Weather, 1).format
    assert codec.loads(codec.dumps(fmt)) == fmt
    assert isinstance(fmt, OutputFormat)


async def test_resuming_with_another_output_type_does_not_replay_the_answer(
    tmp_path: Path,
) -> None:
    runtime = SqliteRuntime(tmp_path / "journal.db")
    try:
        agent = _agent(ScriptedModel([GOOD]), runtime=runtime, output_type=Weather)
        await agent.run("weather?", session_id="s", user_id="u")
        strict = agent.clone(model=ScriptedModel([GOOD]), tuning=Tuning(strict_replay=True))
        with pytest.raises(ReplayDivergenceError, match="model_call_0"):
            await strict.resume("weather?", session_id="s", user_id="u", output_type=Forecast)
        lenient_model = ScriptedModel([GOOD])
        plain = await agent.clone(model=lenient_model, output_type=None).resume(
            "weather?", session_id="s", user_id="u"
        )
        assert lenient_model.calls == 1  # asked afresh: the journaled call had another key
        assert plain.parsed is None
    finally:
        await runtime.close()


async def test_every_backend_replays_the_attempts_in_another_worker(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    first_model = ScriptedModel(['{"city": "Oslo"}', GOOD])
    first = await _agent(first_model, runtime=await runtime_factory(), output_type=Weather).run(
        "weather?", session_id="s", user_id="u"
    )
    assert first_model.calls == 2
    other_model = ScriptedModel([])
    other = _agent(other_model, runtime=await runtime_factory(), output_type=Weather)
    again = await other.resume("weather?", session_id="s", user_id="u")
    assert other_model.calls == 0
    assert again.parsed == first.parsed == Weather(city="Oslo", temp_c=3.5)
    assert again.turns == 2
