"""loomflow's own log lines are scrubbed by the agent's redactor even when no audit log is
configured.

Only an ``AuditLog`` installed the log redaction, so an agent without one (the README's first
example) wrote a failing tool's message, secrets and all, into the ``loomflow.tools`` DEBUG
record and its traceback, while the same text on the tool's span was redacted.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from loomflow.agent import Agent
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import InMemoryRuntime
from loomflow.telemetry import Telemetry
from loomflow.telemetry.testing import SpanCapture
from loomflow.tools import tool

pytestmark = pytest.mark.timeout(60)

# Known only to this test's settings: no redactor another test left alive can hide it.
CONFIGURED = "vault-secret-h42v-5519"
EMAIL = "dana.h42v@example.com"


@tool
def connect(host: str) -> str:
    """Connect to a database."""
    raise ConnectionError(f"login to {host} as {EMAIL} with {CONFIGURED} refused")


def _logged(records: list[logging.LogRecord]) -> str:
    formatter = logging.Formatter()
    return "\n".join(formatter.format(r) for r in records)


async def test_a_failing_tools_secret_is_not_logged_by_an_agent_without_an_audit_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LOOMFLOW_REDACT_SECRETS", CONFIGURED)

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "done"
        return [ToolCall(id="c1", name="connect", arguments={"host": "db1"})]

    capture = SpanCapture()
    agent = Agent(
        "you connect",
        model=FunctionModel(decide),
        tools=[connect],
        runtime=InMemoryRuntime(),
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=False),
        memory=False,
    )
    with caplog.at_level(logging.DEBUG, logger="loomflow"):
        result = await agent.run("connect", session_id="s1", user_id="dana")
    assert result.output == "done"
    # The tool did raise and its record was written (the check below could not pass vacuously).
    raised = [r for r in caplog.records if r.name == "loomflow.tools" and "raised" in r.msg]
    assert raised, "the tool's failure was not logged at all"
    logged = _logged(caplog.records)
    assert "ConnectionError" in logged
    assert CONFIGURED not in logged
    assert EMAIL not in logged
    # The span of the same call was redacted already: the log now matches it.
    [span] = [s for s in capture.spans if s.name == "execute_tool connect"]
    assert CONFIGURED not in (span.status.description or "")


def test_the_cli_log_line_still_names_the_exception_of_a_scrubbed_record() -> None:
    # Scrubbing drops the exception object from a record (its message may hold the secret)
    # and keeps the redacted traceback. The CLI's one-line handler read only the object, so
    # once any agent or audit log had installed the redaction, `loomflow worker` printed
    # "sweep failed (trying again in 5s)" and no longer said why.
    import io

    from loomflow.cli.main import _CliLogHandler
    from loomflow.redaction import Redactor, install_log_redaction

    redactor = Redactor(secrets=[CONFIGURED])
    install_log_redaction(redactor)
    out = io.StringIO()
    handler = _CliLogHandler(out)
    logger = logging.getLogger("loomflow.recovery")
    logger.addHandler(handler)
    try:
        try:
            raise ConnectionError(f"journal down, password {CONFIGURED}\nsecond line")
        except ConnectionError:
            logger.warning("sweep failed (trying again in %gs)", 5, exc_info=True)
    finally:
        logger.removeHandler(handler)
    line = out.getvalue()
    assert line == (
        "loomflow: warning: sweep failed (trying again in 5s): "
        "ConnectionError: journal down, password [REDACTED]\\nsecond line\n"
    )
