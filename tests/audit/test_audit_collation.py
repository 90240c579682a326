"""Action families (``tool.*``, ``legal_hold.*``) select exactly the actions that start with
the prefix, whatever the PostgreSQL database's collation.

Before, a family was the text range ``prefix <= action < next(prefix)``, which holds only
under a byte-order collation (SQLite, PostgreSQL's ``C``). Most PostgreSQL installations sort
by a language's rules instead (``en_US.UTF-8``, an ICU locale): ``'tool.*'`` also matched
``Tool.x``, and under the rules that pass over punctuation (glibc's ``en_US``, ICU's
``ka-shifted``) ``legal_hold.placed`` sorts after ``legal_hold/``, so no hold was ever found:
``users holds`` listed none and ``users forget`` erased a held user.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from loomflow import Agent
from loomflow.audit import AuditLog, PostgresAuditStore
from loomflow.config import Settings
from loomflow.errors import LegalHoldError
from loomflow.models import ScriptedModel
from loomflow.stores import Stores

# ICU's American English (letters before their capitals, punctuation counted) and the same
# with punctuation passed over, as glibc's en_US.UTF-8 does.
_LOCALES = ["en-US", "en-US-u-ka-shifted"]


async def _execute(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(params=_LOCALES)
async def linguistic_dsn(request: pytest.FixtureRequest, pg_dsn: str) -> AsyncIterator[str]:
    """A new PostgreSQL database whose default collation is a language's, not byte order
    (made from the test's own database, on the same server)."""
    name = f"{pg_dsn.rpartition('/')[2]}_{request.param.replace('-', '_').lower()}"
    create = f"TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE '{request.param}' LOCALE 'C'"
    await _execute(pg_dsn, f'CREATE DATABASE "{name}" {create}')
    try:
        yield f"{pg_dsn.rpartition('/')[0]}/{name}"
    finally:
        await _execute(pg_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


_ACTIONS = ["tool.call", "tool.result", "Tool.call", "toolbox.open", "tool", "tool_x", "tool-a"]


@pytest.mark.postgres
async def test_a_family_selects_exactly_its_actions_under_a_linguistic_collation(
    linguistic_dsn: str,
) -> None:
    log = AuditLog(PostgresAuditStore(linguistic_dsn))
    try:
        for action in _ACTIONS:
            await log.record(action, user_id="ana", actor="test", payload={})
        page = await log.query(action="tool.*", limit=100)
        assert [e.action for e in page.entries] == ["tool.call", "tool.result"]
        assert await log.count(action="Tool.*") == 1
        assert await log.count(user_id="ana", action="tool*") == 6
    finally:
        await log.close()


@pytest.mark.postgres
async def test_a_hold_is_found_and_keeps_forget_off_under_a_linguistic_collation(
    linguistic_dsn: str,
) -> None:
    settings = Settings(runtime_url=linguistic_dsn)
    async with Stores(settings) as stores:
        agent = Agent.from_settings(
            "S.", model=ScriptedModel(["hi"]), settings=settings, runtime=stores.runtime
        )
        async with agent:
            await agent.run("hello", session_id="s-1", user_id="ana")
        await stores.audit.place_hold("ana", reason="litigation L-7", actor="legal:dana")
        assert await stores.audit.legal_hold("ana") is not None
        assert [h.user_id for h in await stores.audit.legal_holds()] == ["ana"]
        with pytest.raises(LegalHoldError, match="litigation L-7"):
            await stores.forget_user("ana")
        assert (await stores.runtime.sessions(user_id="ana"))[0].entries > 0
