"""A snapshot records the run's output contract; a resume under another one does not restore it.

A finished structured run (``output_type=Weather``) resumed by an agent asking for another type
restored the snapshot and validated the old answer into the new type: a wrong ``parsed`` (or a
confusing ``OutputValidationError``), where a resume without checkpoints asks the model again
(the output format keys the journal's model calls) or, under ``strict_replay``, raises
``ReplayDivergenceError``. The contract now travels in the stored payload (no new column), and
snapshots written before it did still restore.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import pytest
from pydantic import BaseModel, create_model

from loomflow.agent import Agent, Tuning
from loomflow.checkpoints import SqlCheckpointStore, checkpoint_store_for
from loomflow.errors import CheckpointError, ReplayDivergenceError, UserError
from loomflow.models import ScriptedModel
from loomflow.runtime import JournalRuntime, codec


class Weather(BaseModel):
    city: str
    temp_c: float


class Report(BaseModel):
    """Every field has a default: the old answer validates into it, wrongly."""

    city: str = "?"
    temp_c: float = 0.0
    source: str = "none"


WEATHER = '{"city": "Oslo", "temp_c": 3.5}'
REPORT = '{"city": "Bergen", "temp_c": 1.0, "source": "met.no"}'


def _agent(runtime: JournalRuntime, answers: list[str], **options: object) -> Agent:
    options.setdefault("tuning", Tuning(checkpoint=True))
    return Agent(
        "weather bot",
        model=ScriptedModel(answers),
        runtime=runtime,
        memory=False,
        telemetry=False,
        **options,  # type: ignore[arg-type]
    )


async def _finished(runtime: JournalRuntime) -> Agent:
    agent = _agent(runtime, [WEATHER], output_type=Weather)
    await agent.run("weather?", session_id="s", user_id="u")
    return agent


async def test_a_resume_under_another_output_type_asks_the_model_again(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    await _finished(await runtime_factory())
    resumed = _agent(await runtime_factory(), [REPORT], output_type=Report)
    result = await resumed.resume("weather?", session_id="s", user_id="u")
    assert result.restored_from is None  # what a resume without checkpoints does too
    assert result.parsed == Report(city="Bergen", temp_c=1.0, source="met.no")
    assert isinstance(resumed.model, ScriptedModel)
    assert resumed.model.calls == 1
    # The new answer's snapshot records the new contract, so the next resume restores it.
    again = _agent(await runtime_factory(), [], output_type=Report)
    restored = await again.resume("weather?", session_id="s", user_id="u")
    assert restored.restored_from is not None
    assert restored.parsed == result.parsed


async def test_strict_replay_raises_the_divergence_as_without_checkpoints(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    await _finished(await runtime_factory())
    strict = _agent(
        await runtime_factory(),
        [REPORT],
        output_type=Report,
        tuning=Tuning(checkpoint=True, strict_replay=True),
    )
    with pytest.raises(ReplayDivergenceError, match="model_call_0"):
        await strict.resume("weather?", session_id="s", user_id="u")


async def test_a_plain_resume_of_a_structured_run_and_back(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    await _finished(await runtime_factory())
    plain = await _agent(await runtime_factory(), ["sunny"]).resume(
        "weather?", session_id="s", user_id="u"
    )
    assert plain.restored_from is None
    assert (plain.output, plain.parsed) == ("sunny", None)
    typed = await _agent(await runtime_factory(), [WEATHER], output_type=Weather).resume(
        "weather?", session_id="s", user_id="u"
    )
    assert typed.restored_from is None  # the newest snapshot is the plain run's
    assert typed.parsed == Weather(city="Oslo", temp_c=3.5)


async def test_the_same_output_type_still_restores(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    await _finished(await runtime_factory())
    result = await _agent(await runtime_factory(), [], output_type=Weather).resume(
        "weather?", session_id="s", user_id="u"
    )
    assert result.restored_from is not None
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)


async def test_a_fork_under_another_output_type_is_refused_by_name(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    agent = await _finished(await runtime_factory())
    [snapshot] = await agent.list_checkpoints("s", user_id="u")
    assert snapshot.output_type == "Weather"
    assert re.fullmatch("[0-9a-f]{64}", snapshot.output_format or "")
    other = _agent(await runtime_factory(), [REPORT], output_type=Report)
    with pytest.raises(UserError, match=r"output_type 'Weather'.*output_type is Report"):
        await other.resume("weather?", session_id="s", user_id="u", from_checkpoint=snapshot.id)
    with pytest.raises(UserError, match="output_type is none"):
        await _agent(await runtime_factory(), []).resume(
            "weather?", session_id="s", user_id="u", from_checkpoint=snapshot.id
        )
    forked = await _agent(await runtime_factory(), [], output_type=Weather).resume(
        "weather?", session_id="s", user_id="u", from_checkpoint=snapshot.id
    )
    assert forked.parsed == Weather(city="Oslo", temp_c=3.5)


# -- the stored payload ----------------------------------------------------------------------


SQL = pytest.mark.parametrize(
    "runtime_factory",
    ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    indirect=True,  # these tests edit the stored row
)


async def _store(runtime: JournalRuntime) -> SqlCheckpointStore:
    store = checkpoint_store_for(runtime)
    assert isinstance(store, SqlCheckpointStore)
    await store.open()
    return store


@SQL
async def test_a_snapshot_written_before_the_contract_was_recorded_still_restores(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    runtime = await runtime_factory()
    agent = await _finished(runtime)
    [snapshot] = await agent.list_checkpoints("s", user_id="u")
    store = await _store(runtime)
    # What loomflow wrote before: the bare transcript.
    await store.db.execute(
        "UPDATE loom_checkpoints SET messages = $1", codec.dumps(list(snapshot.messages))
    )
    [old] = await agent.list_checkpoints("s", user_id="u")
    assert (old.output_type, old.output_format) == (None, None)
    assert old.messages == snapshot.messages
    result = await _agent(runtime, [], output_type=Weather).resume(
        "weather?", session_id="s", user_id="u"
    )
    assert result.restored_from == snapshot.id
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)


@SQL
@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ({"output_format": "../../etc"}, "output_format"),
        ({"output_format": 7}, "output_format"),
        ({"output_type": ["Weather"]}, "output_type"),
        ({"messages": "hi"}, "does not hold a transcript"),
    ],
)
async def test_a_crafted_payload_is_damage_and_resume_replays(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]],
    payload: dict[str, object],
    named: str,
) -> None:
    runtime = await runtime_factory()
    agent = await _finished(runtime)
    [snapshot] = await agent.list_checkpoints("s", user_id="u")
    store = await _store(runtime)
    stored = {
        "messages": list(snapshot.messages),
        "output_type": "Weather",
        "output_format": snapshot.output_format,
        **payload,
    }
    await store.db.execute("UPDATE loom_checkpoints SET messages = $1", codec.dumps(stored))
    with pytest.raises(CheckpointError, match=named):
        await store.latest("s", user_id="u")
    [listed] = await store.listing("s", user_id="u")
    assert named in getattr(listed, "unreadable", "")
    result = await _agent(runtime, [], output_type=Weather).resume(
        "weather?", session_id="s", user_id="u"
    )
    assert result.restored_from is None  # replayed from the journal, for free
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)


async def test_a_changed_schema_under_the_same_name_is_another_contract(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    agent = await _finished(await runtime_factory())
    [snapshot] = await agent.list_checkpoints("s", user_id="u")

    # The model edited between deployments: a field more, the same name.
    edited = create_model("Weather", city=(str, ...), temp_c=(float, ...), wind=(float, 0.0))
    changed = _agent(await runtime_factory(), [WEATHER], output_type=edited)
    with pytest.raises(UserError, match="output_type Weather had another schema"):
        await changed.resume("weather?", session_id="s", user_id="u", from_checkpoint=snapshot.id)
    result = await changed.resume("weather?", session_id="s", user_id="u")
    assert result.restored_from is None
    assert result.parsed == edited(city="Oslo", temp_c=3.5, wind=0.0)
