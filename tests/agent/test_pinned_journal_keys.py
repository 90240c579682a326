"""The journal keys, fingerprints and stored bytes an agent run writes, pinned.

Journals written by an earlier release must replay: a change to how a step's name is hashed,
its inputs fingerprinted or its result printed (a faster printer, a shared print) would make
every stored step a divergence, run again. The figures below were written by the release
before the printing was shared between a tool step's name and its fingerprint.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path
from typing import Any

from loomflow.agent import Agent
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime
from loomflow.tools import tool


@tool
async def lookup(key: str, tags: list[str], nested: dict[str, Any]) -> dict[str, Any]:
    """Look up a record."""
    return {"key": key, "tags": tags, "n": len(nested)}


def _model() -> FunctionModel:
    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        done = sum(1 for m in messages if m.role == "tool")
        if done >= 2:
            return "fertig"
        arguments = {"tags": ["é", "b"], "key": f"k{done}", "nested": {"z": 1, "a": [None]}}
        return [ToolCall(id=f"c{done}", name="lookup", arguments=arguments)]

    return FunctionModel(decide)


# (name, fingerprint, SHA-256 of the stored value) of every step but the episode's (its id
# is new on every run).
PINNED = [
    (
        "model_call_0",
        "82b98dc14edb6ab3f07b6bd7596800e40ebff9f1baec8738b4df5e2307683584",
        "43a84f2ed9d45cb61717232d4805308ddc001dc6aa07aa75253a347057c907ce",
    ),
    (
        "tool_call_0_0_a57b7398f537dddd",
        "acb0629e43c1eee98ecbb8afa4aab84b90724298e2931d1acac83c0812e5e6a4",
        "66527e7458822848899ca39970ed235373908f78e208dc36d32189969b3de6b3",
    ),
    (
        "model_call_1",
        "1d78f8c565d86ce3b0147a790aa31af9be1aab794d67654051ee7274874c765f",
        "e6477d081a7c3a8ef8ff53dcdba3fe9f745fb8b2390e8be153d16936fff571fd",
    ),
    (
        "tool_call_1_0_b9d6b8da79d2dfc7",
        "8265eb756af1b491516f4e703d3103b57e30f123cb17536f7d2011c4e821e4da",
        "123933c65531681b53d2206e9a845cbfe91815c3cd789db2b76c7ab248c3f755",
    ),
    (
        "model_call_2",
        "64a2b8f0fb3e466e451001b016646045ecaa2fd3c6cc58885e12cdcd0da12359",
        "77e3757fda757cf25df2d3bdc6a2f7648d1525926d0845eb15fd19baa16d8c98",
    ),
]


def _agent(path: Path) -> Agent:
    return Agent("Hi.", model=_model(), tools=[lookup], runtime=SqliteRuntime(path), name="p")


async def test_an_agent_run_journals_the_pinned_keys_and_replays_them(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    result = await _agent(path).run("go", session_id="s", user_id="u")
    assert result.output == "fertig"
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT name, fingerprint, value FROM loom_entries "
            "WHERE name NOT LIKE 'persist_episode%' ORDER BY seq"
        ).fetchall()
    assert [(name, fp, hashlib.sha256(value).hexdigest()) for name, fp, value in rows] == PINNED
    # A fresh agent (another process, as far as kept prints go) replays every step.
    again = await _agent(path).resume("go", session_id="s", user_id="u")
    assert again.fresh_steps == 0
    assert again.output == "fertig"
