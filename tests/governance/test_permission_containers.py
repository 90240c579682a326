"""Argument globs on lists, mappings and other non-text values: a rule that restricts (deny,
ask) matches when any element does, a rule that allows only when every element does."""

from __future__ import annotations

from typing import Any

import pytest

from loomflow.agent import Agent, RunFinished
from loomflow.governance import (
    PermissionContext,
    PermissionDecided,
    Rule,
    StandardPermissions,
)
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime
from loomflow.tools import Tool

sent_to: list[list[str]] = []


def send_mail(recipients: list[str], headers: dict[str, str] | None = None) -> str:
    """Send a mail."""
    sent_to.append(list(recipients))
    return "sent"


def tag(labels: set[str]) -> str:
    """Tag something."""
    return "tagged"


MAIL = Tool(send_mail, edits=True)


def decide(policy: Rule, arguments: dict[str, Any], tool: Tool[..., Any] = MAIL) -> str:
    permissions = StandardPermissions("default", [policy])
    call = ToolCall(id="c", name=tool.name, arguments=arguments)
    return permissions.check(call, context=PermissionContext(tool=tool)).behavior


def test_a_deny_glob_matches_a_list_when_any_element_matches() -> None:
    rule = Rule.deny("send_mail", args={"recipients": "*@rival.com"})
    assert decide(rule, {"recipients": ["ana@corp.com", "bob@rival.com"]}) == "deny"
    assert decide(rule, {"recipients": ["bob@rival.com"]}) == "deny"
    # None matching: the rule does not apply, and the mode decides (edits: ask).
    assert decide(rule, {"recipients": ["ana@corp.com", "kim@corp.com"]}) == "ask"


def test_an_ask_glob_matches_a_list_when_any_element_matches() -> None:
    rule = Rule.ask("send_mail", args={"recipients": "*@external.com"})
    permissions = StandardPermissions("acceptEdits", [rule])
    call = ToolCall(
        id="c", name="send_mail", arguments={"recipients": ["a@corp.com", "b@external.com"]}
    )
    assert permissions.check(call, context=PermissionContext(tool=MAIL)).behavior == "ask"


def test_an_allow_glob_matches_a_list_only_when_every_element_matches() -> None:
    rule = Rule.allow("send_mail", args={"recipients": "*@corp.com"})
    assert decide(rule, {"recipients": ["ana@corp.com", "kim@corp.com"]}) == "allow"
    # One outsider among insiders is not allowed by the rule (the mode asks), not even
    # by a glob that the list's text as a whole would match.
    assert decide(rule, {"recipients": ["ana@corp.com", "eve@rival.com"]}) == "ask"
    loose = Rule.allow("send_mail", args={"recipients": "*@corp.com*"})
    assert decide(loose, {"recipients": ["ana@corp.com", "eve@rival.com"]}) == "ask"
    # An empty list has no element to vouch for: its text ("[]") decides.
    assert decide(rule, {"recipients": []}) == "ask"
    assert decide(Rule.allow("send_mail", args={"recipients": "*"}), {"recipients": []}) == (
        "allow"
    )


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Forward": "evil.example"},  # a mapping's value
        {"evil.example": "yes"},  # a mapping's key
        {"route": ["ok.example", {"next": "evil.example"}]},  # nested deeper
    ],
)
def test_a_deny_glob_is_not_dodged_by_a_mapping(headers: dict[str, Any]) -> None:
    rule = Rule.deny("send_mail", args={"headers": "evil.*"})
    assert decide(rule, {"recipients": ["a@corp.com"], "headers": headers}) == "deny"


@pytest.mark.parametrize(
    ("pattern", "value"),
    [
        ("22", [80, 22]),  # a number among numbers
        ("null", ["a", None]),  # JSON's spelling of None
        ("None", ["a", None]),  # Python's
        ("true", [[False], [True]]),  # a list of lists
        ("*passwd*", ["/etc/passwd"]),  # the whole list's text still counts for a deny
    ],
)
def test_a_deny_glob_matches_non_text_elements(pattern: str, value: list[Any]) -> None:
    def probe(value: list[Any]) -> str:
        """Probe."""
        return "ok"

    rule = Rule.deny("probe", args={"value": pattern})
    assert decide(rule, {"value": value}, Tool(probe)) == "deny"


def test_a_set_the_tool_receives_is_judged_by_its_elements() -> None:
    tool = Tool(tag, edits=True)
    deny = Rule.deny("tag", args={"labels": "prod*"})
    assert decide(deny, {"labels": ["dev", "production"]}, tool) == "deny"
    allow = Rule.allow("tag", args={"labels": "dev*"})
    assert decide(allow, {"labels": ["dev", "devops"]}, tool) == "allow"
    assert decide(allow, {"labels": ["dev", "production"]}, tool) == "ask"


def mail_model(recipients: list[str]) -> FunctionModel:
    def answer(messages: list[Message], tools: list[ToolSpec]) -> Any:
        results = [m for m in messages if m.role == "tool"]
        if not results:
            return [ToolCall(id="c0", name="send_mail", arguments={"recipients": recipients})]
        return f"model saw: {results[-1].content}"

    return FunctionModel(answer)


@pytest.mark.parametrize(
    ("recipients", "sent"),
    [
        (["ana@corp.com", "kim@corp.com"], True),
        (["ana@corp.com", "eve@rival.com"], False),
    ],
)
async def test_through_the_agent_an_outsider_in_the_list_stops_the_mail(
    tmp_path: Any, recipients: list[str], sent: bool
) -> None:
    # Insiders are allowed, outsiders denied: a list holding one outsider is denied (and
    # would not be allowed by the allow rule on its own either).
    permissions = StandardPermissions(
        "default",
        [
            Rule.allow("send_mail", args={"recipients": "*@corp.com"}),
            Rule.deny("send_mail", args={"recipients": "*@rival.com"}),
        ],
    )
    sent_to.clear()
    agent = Agent(
        "x",
        model=mail_model(recipients),
        tools=[MAIL],
        permissions=permissions,
        runtime=SqliteRuntime(str(tmp_path / "journal.db")),
    )
    events = [e async for e in agent.stream("go", session_id="s", user_id="u")]
    assert isinstance(events[-1], RunFinished)
    [decided] = [e for e in events if isinstance(e, PermissionDecided)]
    assert decided.final == ("allow" if sent else "deny")
    assert sent_to == ([recipients] if sent else [])
    if not sent:
        assert "permission denied" in events[-1].result.output
