"""``Agent.from_settings``: journal, audit log, budget and telemetry from one Settings."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loomflow import Agent, ToolCall, tool
from loomflow.audit import audit_store_from_url
from loomflow.config import Settings
from loomflow.errors import UserError
from loomflow.governance import Cap, StandardBudget
from loomflow.governance.budget import budget_store_from_url
from loomflow.memory import memory_for
from loomflow.messages import ModelResponse, Usage
from loomflow.models import FunctionModel, ScriptedModel
from loomflow.models.pricing import ModelPrice
from loomflow.runtime import InMemoryRuntime, runtime_from_url


@tool
def lookup(order_id: str) -> str:
    """Look an order up."""
    return f"{order_id}: shipped"


def _model() -> ScriptedModel:
    return ScriptedModel(
        [[ToolCall(id="c1", name="lookup", arguments={"order_id": "A-1"})], "A-1 has shipped."]
    )


async def _check_stores(settings: Settings, session: str) -> None:
    runtime = runtime_from_url(settings.runtime_url)
    try:
        entries = await runtime.entries(session, "ana")
        assert [e.name for e in entries][:1] == ["model_call_0"]
        # Two model calls, the tool call, and the episode memory keeps beside the journal.
        assert [e.name for e in entries][3:] == ["persist_episode_2"]
        assert len(await memory_for(runtime).episodes(session, user_id="ana")) == 1
    finally:
        await runtime.close()
    audit = audit_store_from_url(settings.audit_store_url)
    try:
        page = await audit.query(user_id="ana", session_id=session)
        assert next(e.action for e in page.entries) == "run.start"
        assert (await audit.verify(user_id="ana")).ok
    finally:
        await audit.close()
    budget = budget_store_from_url(settings=settings)
    try:
        usage = await budget.usage("ana")
        assert sum(u.totals.calls for u in usage if u.bucket.period == "") == 2
    finally:
        await budget.close()


async def test_sqlite_journal_and_audit_with_the_budget_beside_the_journal(tmp_path: Path) -> None:
    settings = Settings(
        runtime_url=f"sqlite:///{tmp_path / 'journal.db'}",
        audit_url=f"sqlite:///{tmp_path / 'audit.db'}",
    )
    async with Agent.from_settings(
        "Support.", model=_model(), tools=[lookup], settings=settings
    ) as agent:
        result = await agent.run("Where is A-1?", session_id="t-1", user_id="ana")
        assert result.output == "A-1 has shipped."
        assert isinstance(agent.budget, StandardBudget)
    await _check_stores(settings, "t-1")


@pytest.mark.postgres
async def test_postgres_everywhere_from_environment(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOMFLOW_RUNTIME_URL", pg_dsn)
    monkeypatch.setenv("LOOMFLOW_AUDIT_URL", pg_dsn)
    monkeypatch.setenv("LOOMFLOW_BUDGET_URL", pg_dsn)
    agent = Agent.from_settings("Support.", model=_model(), tools=[lookup])
    try:
        await agent.run("Where is A-1?", session_id="t-2", user_id="ana")
    finally:
        await agent.aclose()
    await _check_stores(Settings(), "t-2")


async def test_caps_are_enforced_and_explicit_components_are_kept(tmp_path: Path) -> None:
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}", audit_url="memory://")
    runtime = InMemoryRuntime()
    agent = Agent.from_settings(
        "Support.",
        model=_model(),
        tools=[lookup],
        settings=settings,
        caps=[Cap("tokens_total", 10)],
        runtime=runtime,
    )
    assert agent.runtime is runtime
    result = await agent.run("Where is A-1?", session_id="t-3", user_id="ana")
    assert result.interrupted
    assert result.interruption_reason == "budget:user.tokens_total"
    await agent.aclose()
    # Still open: the caller's runtime is not closed by aclose().
    assert [i.session_id for i in await runtime.sessions()] == ["t-3"]
    await runtime.close()
    assert not (tmp_path / "journal.db").exists()  # the settings' journal was never built


def test_caps_and_a_budget_together_are_refused() -> None:
    with pytest.raises(UserError, match="caps= or budget="):
        Agent.from_settings(
            "x",
            model="scripted",
            caps=[Cap("tokens_total", 10)],
            budget=StandardBudget(),
            settings=Settings(runtime_url="memory://", audit_url="memory://"),
        )


class _OwnModel(FunctionModel):
    """A model no price table knows (not a free scripted one)."""

    provider = "acme"


async def test_prices_price_a_model_of_ones_own_under_a_cost_cap(tmp_path: Path) -> None:
    # from_settings had no prices=: a model of one's own under a cost cap was refused with
    # UnknownModelPriceError, and prices= failed as an unknown Agent argument.
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}", audit_url="memory://")
    model = _OwnModel(
        lambda m, t: ModelResponse(text="ok", usage=Usage(input_tokens=1000, output_tokens=100)),
        name="our-llm",
    )
    async with Agent.from_settings(
        "Support.",
        model=model,
        settings=settings,
        caps=[Cap("cost_usd", 1.0)],
        prices={"Our-LLM": ModelPrice(2.0, 10.0)},
    ) as agent:
        result = await agent.run("hi", session_id="t-p", user_id="ana")
    assert (result.interrupted, result.output) == (False, "ok")
    # 1000 input tokens at $2/M and 100 output at $10/M: $0.003, charged and reported alike.
    assert result.cost_usd == pytest.approx(0.003)
    budget = budget_store_from_url(settings=settings)
    try:
        [usage] = [u for u in await budget.usage("ana") if u.bucket.period == ""]
    finally:
        await budget.close()
    assert usage.totals.cost_nanousd == 3_000_000


def test_prices_and_a_budget_together_are_refused() -> None:
    # The given budget prices the run with its own table: prices= would be ignored silently.
    with pytest.raises(UserError, match="prices= or budget="):
        Agent.from_settings(
            "x",
            model="scripted",
            prices={"our-llm": ModelPrice(1.0, 1.0)},
            budget=StandardBudget(),
            settings=Settings(runtime_url="memory://", audit_url="memory://"),
        )


def test_metrics_port_serves_metrics_once_per_process(tmp_path: Path) -> None:
    # In a child process: telemetry set-up is global to a process.
    script = textwrap.dedent(
        f"""
        import asyncio, socket, urllib.request
        from loomflow import Agent
        from loomflow.config import Settings
        from loomflow.errors import ConfigurationError

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        settings = Settings(
            runtime_url="sqlite:///{tmp_path / "j.db"}", audit_url="memory://",
            metrics_port=port, metrics_host="127.0.0.1",
        )

        # The application set telemetry up itself first: agents reuse it, no second bind.
        from loomflow.telemetry import setup_telemetry
        setup_telemetry(settings)

        async def main():
            async with Agent.from_settings("x", model="scripted", settings=settings) as a:
                await a.run("hello", session_id="s", user_id="u")
            # a second agent with the same settings shares the endpoint
            async with Agent.from_settings("x", model="scripted", settings=settings) as b:
                await b.run("hello again", session_id="s2", user_id="u")

        asyncio.run(main())
        body = urllib.request.urlopen(f"http://127.0.0.1:{{port}}/metrics").read().decode()
        finished = 'backend="sqlite",outcome="finished",resumed="false"'
        assert "loomflow_runs_total{{" + finished + "}} 2.0" in body, body[-2000:]
        try:
            Agent.from_settings("x", model="scripted", settings=settings.model_copy(
                update={{"metrics_port": port + 1}}))
        except ConfigurationError as exc:
            print("refused:", exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "refused: telemetry is already set up" in done.stdout


async def test_without_urls_of_their_own_audit_and_budget_share_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}")
    async with Agent.from_settings(
        "Support.", model=_model(), tools=[lookup], settings=settings
    ) as agent:
        await agent.run("Where is A-1?", session_id="t-4", user_id="ana")
    await _check_stores(settings, "t-4")  # read back through the journal's URL
    files = await asyncio.to_thread(lambda: sorted(p.name for p in tmp_path.iterdir()))
    assert [f for f in files if not f.startswith("journal.db")] == []


async def test_aclose_closes_everything_even_when_one_close_fails(tmp_path: Path) -> None:
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}")
    agent = Agent.from_settings("x", model="scripted", settings=settings)
    await agent.run("hi", session_id="s", user_id="u")
    closed: list[str] = []

    async def broken_close() -> None:
        closed.append("audit")
        raise OSError("disk went away")

    agent.audit.close = broken_close  # type: ignore[union-attr]
    with pytest.raises(OSError, match="disk went away"):
        await agent.aclose()
    assert closed == ["audit"]
    # The runtime after it in the list was still closed: it must reopen to be used again.
    assert agent.runtime is not None
    assert not agent.runtime.database.is_open  # type: ignore[attr-defined]
