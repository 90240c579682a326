"""A run's page shows that run's state, not the state of a later run of the same session."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomflow.agent import Agent
from loomflow.config import Settings
from loomflow.console._data import ConsoleData
from loomflow.errors import ConfigurationError
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.redaction import Redactor
from loomflow.stores import Stores
from loomflow.tools import tool

CALL = [[ToolCall(id="c1", name="check", arguments={"n": 1})], "checked"]


async def test_an_older_run_keeps_its_own_state(tmp_path: Path) -> None:
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}")
    broken = False

    @tool
    def check(n: int) -> int:
        """Check."""
        if broken:
            raise ConfigurationError("misdeployed")  # stops the run: it stays open
        return n

    async with Agent.from_settings(
        "You check.", model=ScriptedModel(CALL), tools=[check], settings=settings, memory=False
    ) as agent:
        first = await agent.run("one", session_id="s", user_id="cy")
        broken = True
        with pytest.raises(ConfigurationError):
            await agent.run("two", session_id="s", user_id="cy")
    async with Stores(settings) as stores:
        data = ConsoleData(stores, Redactor())
        story = await data.run("cy", str(first.run_id))
        assert story.session is not None
        assert story.session.state == "open"  # the session's latest run raised...
        assert story.state == "finished"  # ...but this one returned its answer
