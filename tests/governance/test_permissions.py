"""StandardPermissions: modes, rules, layers and approvals, checked and run through the agent."""

from __future__ import annotations

import asyncio
import enum
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from loomflow.agent import Agent, RunFinished
from loomflow.errors import NewerEntryError, UserError
from loomflow.governance import (
    PERMISSION_DENIED,
    Approval,
    ApprovalRequest,
    Decision,
    Deny,
    PermissionContext,
    PermissionDecided,
    Policy,
    Rule,
    StandardPermissions,
)
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import InMemoryRuntime, SqliteRuntime
from loomflow.tools import Tool

MODES = ("default", "acceptEdits", "bypass", "readOnly")
RULES = ("none", "allow", "ask", "deny")
# The contract, spelled out: per mode and rule, the decision for a tool that is
# (plain, edits, destructive, edits and destructive). A = allow, S = ask, D = deny.
EXPECTED = {
    "default": {"none": "ASSS", "allow": "AAAA", "ask": "SSSS", "deny": "DDDD"},
    "acceptEdits": {"none": "AASS", "allow": "AAAA", "ask": "SSSS", "deny": "DDDD"},
    "bypass": {"none": "AAAA", "allow": "AAAA", "ask": "AAAA", "deny": "DDDD"},
    "readOnly": {"none": "ADDD", "allow": "ADDD", "ask": "SDDD", "deny": "DDDD"},
}
LETTER = {"A": "allow", "S": "ask", "D": "deny"}
FLAGS = [(False, False), (True, False), (False, True), (True, True)]  # (edits, destructive)

ran: list[dict[str, Any]] = []


def make_tool(*, edits: bool, destructive: bool) -> Tool[..., Any]:
    def write_record(record: str, secret: str = "") -> str:
        """Write a record."""
        ran.append({"record": record, "secret": secret})
        return f"wrote {record}"

    return Tool(write_record, edits=edits, destructive=destructive, sensitive=("secret",))


def one_call(arguments: dict[str, Any] | None = None, times: int = 1) -> FunctionModel:
    """Calls ``write_record`` ``times`` times (one per turn), then repeats the last result."""

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        results = [m for m in messages if m.role == "tool"]
        if len(results) < times:
            args = arguments or {"record": "r1", "secret": "hunter2"}
            return [ToolCall(id=f"c{len(results)}", name="write_record", arguments=args)]
        return f"model saw: {results[-1].content}"

    return FunctionModel(decide)


async def run_agent(
    permissions: StandardPermissions,
    target: Tool[..., Any],
    model: FunctionModel | None = None,
    **kwargs: Any,
) -> tuple[Any, list[PermissionDecided]]:
    agent = Agent("x", model=model or one_call(), tools=[target], permissions=permissions)
    events = [e async for e in agent.stream("go", **kwargs)]
    assert isinstance(events[-1], RunFinished)
    return events[-1].result, [e for e in events if isinstance(e, PermissionDecided)]


CASES = [
    (mode, rule, edits, destructive)
    for mode in MODES
    for rule in RULES
    for edits, destructive in FLAGS
]


@pytest.mark.parametrize(
    ("mode", "rule", "edits", "destructive"),
    CASES,
    ids=[f"{m}-{r}-{'e' if e else '_'}{'d' if d else '_'}" for m, r, e, d in CASES],
)
async def test_every_mode_rule_and_flag(
    mode: Any, rule: str, edits: bool, destructive: bool
) -> None:
    index = FLAGS.index((edits, destructive))
    expected = LETTER[EXPECTED[mode][rule][index]]
    rules = [] if rule == "none" else [Rule(rule, "write_*")]  # type: ignore[arg-type]
    asked: list[ApprovalRequest] = []

    def approve(request: ApprovalRequest) -> Approval:
        asked.append(request)
        return Approval.allow(by="reviewer")

    permissions = StandardPermissions(mode, rules, approval=approve)
    target = make_tool(edits=edits, destructive=destructive)
    decision = permissions.check(
        ToolCall(id="c", name="write_record", arguments={"record": "r"}),
        user_id="u",
        context=PermissionContext(tool=target),
    )
    assert decision.behavior == expected, decision

    # The same case through the agent loop: an ask goes to the handler (which approves).
    ran.clear()
    result, [event] = await run_agent(permissions, target, user_id="u")
    assert event.decision == expected
    assert len(asked) == (1 if expected == "ask" else 0)
    assert event.final == ("deny" if expected == "deny" else "allow")
    assert bool(ran) == (expected != "deny")
    assert not result.interrupted  # a denial never ends the run
    if expected == "deny":
        assert result.output.startswith("model saw: Error: permission denied:")
    if expected == "ask":
        assert event.approver == "reviewer"


def test_deny_beats_ask_beats_allow_across_layers() -> None:
    plain = make_tool(edits=False, destructive=False)
    permissions = StandardPermissions(
        "default",
        [Rule.allow("*")],
        roles={"support": Policy([Rule.ask("write_*")]), "auditor": Policy(mode="readOnly")},
        users={"mallory": Policy([Rule.deny("write_record", reason="mallory may not write")])},
    )
    call = ToolCall(id="c", name="write_record", arguments={"record": "r"})

    def check(user: str, **metadata: Any) -> Decision:
        ctx = PermissionContext.from_metadata(metadata, tool=plain)
        return permissions.check(call, user_id=user, context=ctx)

    assert (check("alice").behavior, check("alice").policy) == ("allow", "global")
    assert (check("alice", role="support").behavior, check("alice", role="support").policy) == (
        "ask",
        "role:support",
    )
    denied = check("mallory", role="support")
    assert (denied.behavior, denied.policy, denied.reason) == (
        "deny",
        "user:mallory",
        "mallory may not write",
    )
    assert check("alice", role=["support", "nobody"]).behavior == "ask"
    with pytest.raises(UserError, match="role name"):  # read as no role, it shed the role's
        check("alice", role=42)  # restrictions (see test_a_role_that_is_no_name_denies...)


def test_the_users_mode_wins_and_among_roles_the_strictest() -> None:
    edit = make_tool(edits=True, destructive=False)
    permissions = StandardPermissions(
        "default",
        roles={"dev": Policy(mode="acceptEdits"), "viewer": Policy(mode="readOnly")},
        users={"root": Policy(mode="bypass")},
    )
    call = ToolCall(id="c", name="write_record", arguments={})

    def behavior(user: str, roles: list[str]) -> str:
        ctx = PermissionContext.from_metadata({"role": roles}, tool=edit)
        return permissions.check(call, user_id=user, context=ctx).behavior

    assert behavior("a", []) == "ask"
    assert behavior("a", ["dev"]) == "allow"
    assert behavior("a", ["dev", "viewer"]) == "deny"
    assert behavior("root", ["viewer"]) == "allow"


def test_argument_rules() -> None:
    permissions = StandardPermissions(
        "default",
        [
            Rule.deny("shell", args={"command": "rm *"}),
            Rule.ask("shell", args={"command": "sudo *"}),
            Rule.deny("transfer", args={"amount": lambda v: v > 1000}),
            Rule.ask("transfer", when=lambda a: a.get("currency") != "EUR"),
            Rule.deny("fetch", args={"port": "22"}),
        ],
    )

    def check(name: str, **arguments: Any) -> str:
        return permissions.check(ToolCall(id="c", name=name, arguments=arguments)).behavior

    assert check("shell", command="rm -rf /") == "deny"
    assert check("shell", command="sudo ls") == "ask"
    assert check("shell", command="ls") == "allow"
    assert check("shell") == "allow"  # a missing argument does not match
    assert check("transfer", amount=5000, currency="EUR") == "deny"
    assert check("transfer", amount=5, currency="USD") == "ask"
    assert check("transfer", amount=5, currency="EUR") == "allow"
    assert check("fetch", port=22) == "deny"  # non-strings are matched as text


def test_an_argument_glob_matches_a_non_string_as_python_and_as_json_write_it() -> None:
    # A model sends JSON true; str() made it "True", so a rule written "true" never denied.
    permissions = StandardPermissions(
        "default",
        [
            Rule.deny("deploy", args={"force": "true"}),
            Rule.deny("deploy", args={"target": "null"}),
            Rule.deny("deploy", args={"hosts": '*"prod*'}),
            Rule.deny("wipe", args={"all": "True"}),
        ],
    )

    def check(name: str, **arguments: Any) -> str:
        return permissions.check(ToolCall(id="c", name=name, arguments=arguments)).behavior

    assert check("deploy", force=True) == "deny"
    assert check("deploy", target=None) == "deny"
    assert check("deploy", hosts=["staging", "prod-1"]) == "deny"
    assert check("wipe", all=True) == "deny"  # as Python writes it, as before
    assert check("deploy", force=False, target="staging", hosts=["staging"]) == "allow"


def test_a_failing_rule_denies() -> None:
    permissions = StandardPermissions("bypass", [Rule.allow("*", when=lambda a: a["missing"])])
    decision = permissions.check(ToolCall(id="c", name="anything", arguments={}))
    assert (decision.behavior, decision.policy) == ("deny", "error")
    assert "KeyError" in decision.reason


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(UserError, match="mode"):
        StandardPermissions("yolo")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="behavior"):
        Rule("maybe")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="glob"):
        Rule.allow("shell", args={"command": 3})
    with pytest.raises(UserError, match="Policy"):
        StandardPermissions(roles={"x": [Rule.allow()]})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (lambda: Rule.deny("wipe", destructive="true"), "destructive must be True, False"),
        (lambda: Rule.deny("wipe", edits=1), "edits must be True, False"),
        (lambda: Rule.deny("wipe", args={1: "prod*"}), "argument names are strings"),
        (lambda: Rule.deny("wipe", args=["target"]), "args must be a mapping"),
        (lambda: Rule.deny("wipe", when="prod"), "when must be a predicate"),
        (lambda: Rule.deny("wipe", reason=5), "reason must be text"),
        (lambda: Policy(Rule.deny("wipe")), "rules must be a list of Rule"),
        (lambda: StandardPermissions("default", Rule.deny("wipe")), "rules must be a list"),
        (lambda: StandardPermissions(roles=[Policy()]), "roles must be a mapping"),
        (lambda: StandardPermissions(users={7: Policy()}), "users are keyed by strings"),
        # No run has such a user id: the user's deny rules would never apply.
        (lambda: StandardPermissions(users={"": Policy()}), "must not be empty"),
        (lambda: StandardPermissions(users={"ana\n": Policy()}), "control character"),
        (lambda: StandardPermissions(users={"a" * 300: Policy()}), "256-byte limit"),
        (lambda: StandardPermissions(approval_timeout="5"), "approval_timeout must be"),
        (lambda: StandardPermissions(approval_timeout=True), "approval_timeout must be"),
    ],
)
def test_a_malformed_rule_or_policy_is_refused_when_built(build: Any, said: str) -> None:
    """Such a rule would never match (a deny written to stop a call would let it run), or
    fail at the first call: refused with a UserError naming the problem instead."""
    with pytest.raises(UserError, match=said):
        build()


async def test_a_deny_rule_on_a_flag_still_stops_a_destructive_tool() -> None:
    ran.clear()
    target = make_tool(edits=False, destructive=True)
    permissions = StandardPermissions("bypass", [Rule.deny("*", destructive=True)])
    _result, [event] = await run_agent(permissions, target, user_id="u")
    assert event.final == "deny"
    assert ran == []


@pytest.mark.parametrize(
    ("by", "said"),
    [("kim\x1b[2J\nroot", "control character"), ("k" * 1000, "bytes long"), (5, "string")],
)
async def test_an_approval_by_a_hostile_approver_name_denies(by: Any, said: str) -> None:
    """The approver becomes the audit actor (approver:<by>): held to the rules of ids, as the
    decided_by of a deferred approval is. A handler that cannot name one denies."""
    ran.clear()
    target = make_tool(edits=True, destructive=True)
    permissions = StandardPermissions(approval=lambda request: Approval.allow(by=by))
    result, [event] = await run_agent(permissions, target, user_id="u")
    assert (event.decision, event.final, event.approver) == ("ask", "deny", None)
    assert said in event.reason
    assert ran == []
    assert "permission denied" in result.output


async def test_no_handler_means_deny_and_the_model_is_told() -> None:
    ran.clear()
    target = make_tool(edits=True, destructive=True)
    result, [event] = await run_agent(StandardPermissions(), target, user_id="u")
    assert (event.decision, event.final) == ("ask", "deny")
    assert "no approval handler" in event.reason
    assert ran == []
    assert "permission denied" in result.output
    assert not result.interrupted


@pytest.mark.parametrize(
    ("handler", "reason"),
    [
        (lambda request: 1 / 0, "ZeroDivisionError"),
        (lambda request: "yes", "not an Approval"),
        (lambda request: False, "not approved"),
        (lambda request: Approval.deny("too risky", by="ops"), "too risky"),
    ],
    ids=["raises", "junk", "false", "deny"],
)
async def test_a_handler_that_does_not_approve_denies(handler: Any, reason: str) -> None:
    ran.clear()
    target = make_tool(edits=False, destructive=True)
    _, [event] = await run_agent(StandardPermissions(approval=handler), target)
    assert event.final == "deny"
    assert reason in event.reason
    assert ran == []


async def test_a_slow_handler_times_out_into_a_denial() -> None:
    async def slow(request: ApprovalRequest) -> Approval:
        await asyncio.sleep(5)
        return Approval.allow()

    permissions = StandardPermissions(approval=slow, approval_timeout=0.05)
    _, [event] = await run_agent(permissions, make_tool(edits=False, destructive=True))
    assert (event.final, event.reason) == ("deny", "no approval within 0.05 s")


async def test_a_slow_sync_handler_times_out_into_a_denial() -> None:
    ran.clear()

    def slow(request: ApprovalRequest) -> Approval:
        time.sleep(0.3)  # holds the event loop, so no timer can interrupt it
        return Approval.allow(by="late")

    # The answer came after the timeout and used to be taken: the call ran.
    permissions = StandardPermissions(approval=slow, approval_timeout=0.05)
    _, [event] = await run_agent(permissions, make_tool(edits=False, destructive=True))
    assert (event.final, event.reason) == ("deny", "no approval within 0.05 s")
    assert ran == []


async def test_an_approver_can_edit_the_arguments() -> None:
    ran.clear()

    async def edit(request: ApprovalRequest) -> Approval:
        assert request.redacted_arguments == {"record": "r1", "secret": "[REDACTED]"}
        return Approval.edit({**request.call.arguments, "record": "r1-reviewed"}, by="lead")

    target = make_tool(edits=False, destructive=True)
    result, [event] = await run_agent(StandardPermissions(approval=edit), target)
    assert ran == [{"record": "r1-reviewed", "secret": "hunter2"}]
    assert (event.final, event.edited, event.approver) == ("allow", True, "lead")
    assert event.arguments == {"record": "r1-reviewed", "secret": "[REDACTED]"}
    assert "hunter2" not in json.dumps(event.model_dump())
    assert result.output == "model saw: wrote r1-reviewed"


KEY = "sk-" + "abcdefghijklmnopqrstuvwx"  # an API key's shape, in an argument not `sensitive`
CARD = "4111 1111 1111 1111"


async def test_an_in_process_approver_sees_no_more_than_a_deferred_one() -> None:
    # In process, redacted_arguments hid only the `sensitive` names: the key and the card in
    # "record" were shown, while `approvals list` shows the same request with them redacted.
    arguments = {"record": f"r1 {KEY} paid with {CARD}", "secret": "hunter2"}
    target = make_tool(edits=False, destructive=True)
    shown: list[dict[str, Any]] = []

    def look(request: ApprovalRequest) -> Approval:
        shown.append(request.redacted_arguments)
        return Approval.deny("no")

    await run_agent(StandardPermissions(approval=look), target, one_call(arguments))
    deferred = Agent(
        "x",
        model=one_call(arguments),
        tools=[target],
        permissions=StandardPermissions(approval="defer"),
        runtime=InMemoryRuntime(),
    )
    [pending] = (await deferred.run("go", session_id="s")).pending_approvals
    assert shown == [pending.arguments]
    assert KEY not in json.dumps(shown)
    assert "4111" not in json.dumps(shown)
    assert shown[0]["secret"] == "[REDACTED]"


async def test_an_edit_that_keeps_a_redacted_secret_shape_is_denied() -> None:
    ran.clear()
    arguments = {"record": f"r1 {KEY}", "secret": "hunter2"}

    async def edit(request: ApprovalRequest) -> Approval:
        return Approval.edit({**request.redacted_arguments, "secret": "s3"}, by="lead")

    target = make_tool(edits=False, destructive=True)
    _, [event] = await run_agent(StandardPermissions(approval=edit), target, one_call(arguments))
    assert ran == []
    assert event.final == "deny"
    assert "'record'" in event.reason


async def test_an_approvers_deny_reason_reaches_the_model_redacted() -> None:
    # The audit entry redacted the reason, but the model (and so the journal, the provider and
    # result.messages) got the card number as the approver typed it.
    permissions = StandardPermissions(
        approval=lambda request: Approval.deny(f"card {CARD} is flagged, key {KEY}", by="kim")
    )
    target, runtime = make_tool(edits=False, destructive=True), InMemoryRuntime()
    agent = Agent("x", model=one_call(), tools=[target], permissions=permissions, runtime=runtime)
    result = await agent.run("go", session_id="s")
    [denied] = [m for m in result.messages if m.role == "tool"]
    assert denied.is_error
    assert "[REDACTED:card] is flagged" in denied.content
    assert "4111" not in denied.content
    assert KEY not in denied.content
    assert "4111" not in result.output
    again = await agent.resume("go", session_id="s")
    assert again.output == result.output


async def test_a_deferred_deny_reason_reaches_the_model_redacted() -> None:
    permissions = StandardPermissions(approval="defer")
    target, runtime = make_tool(edits=False, destructive=True), InMemoryRuntime()
    agent = Agent("x", model=one_call(), tools=[target], permissions=permissions, runtime=runtime)
    [pending] = (await agent.run("go", session_id="s")).pending_approvals
    decision = Deny(f"card {CARD} is flagged")
    result = await agent.resume("go", session_id="s", approvals={pending.request_id: decision})
    [denied] = [m for m in result.messages if m.role == "tool"]
    assert "[REDACTED:card] is flagged" in denied.content
    assert "4111" not in denied.content


async def test_an_edit_that_keeps_a_redacted_value_is_denied_not_run_with_it() -> None:
    # A handler that shows redacted_arguments to a person and sends back their edit of it
    # ran the tool with "[REDACTED]" as the secret.
    ran.clear()

    async def edit(request: ApprovalRequest) -> Approval:
        return Approval.edit({**request.redacted_arguments, "record": "r2"}, by="lead")

    target = make_tool(edits=False, destructive=True)
    result, [event] = await run_agent(StandardPermissions(approval=edit), target)
    assert ran == []
    assert event.final == "deny"
    assert "'secret'" in event.reason
    assert "redacted" in event.reason
    assert "permission denied" in result.output


async def test_edited_arguments_still_face_the_deny_rules() -> None:
    ran.clear()
    permissions = StandardPermissions(
        rules=[Rule.deny("write_record", args={"record": "prod-*"})],
        approval=lambda request: Approval.edit({"record": "prod-db"}),
    )
    _, [event] = await run_agent(permissions, make_tool(edits=False, destructive=True))
    assert event.final == "deny"
    assert "edited arguments are denied" in event.reason
    assert ran == []


async def test_a_remembered_answer_holds_for_the_rest_of_the_run_only() -> None:
    ran.clear()
    asked: list[str] = []

    def approve(request: ApprovalRequest) -> Approval:
        asked.append(request.call.id)
        return Approval.allow(remember=True, by="ops")

    permissions = StandardPermissions(approval=approve)
    target = make_tool(edits=False, destructive=True)
    _, events = await run_agent(permissions, target, model=one_call(times=3))
    assert asked == ["c0"]
    assert [e.final for e in events] == ["allow"] * 3
    assert "remembered" in events[1].reason
    assert len(ran) == 3
    await run_agent(permissions, target)  # a new run asks again
    assert len(asked) == 2


async def test_a_replayed_tool_result_is_not_checked_again() -> None:
    checks: list[str] = []

    class Counting(StandardPermissions):
        def check(self, call: ToolCall, **kwargs: Any) -> Decision:
            checks.append(call.name)
            return super().check(call, **kwargs)

    ran.clear()
    runtime = InMemoryRuntime()
    permissions = Counting("bypass")
    target = make_tool(edits=True, destructive=True)
    agent = Agent("x", model=one_call(), tools=[target], permissions=permissions, runtime=runtime)
    await agent.run("go", session_id="s", user_id="u")
    resumed = await agent.resume("go", session_id="s", user_id="u")
    assert resumed.replayed_steps == 4  # two model calls, the tool call, the episode write
    assert checks == ["write_record"]
    assert len(ran) == 1


async def test_a_denial_is_journaled_and_replays_as_a_denial() -> None:
    runtime = InMemoryRuntime()
    agent = Agent(
        "x",
        model=one_call(),
        tools=[make_tool(edits=False, destructive=True)],
        permissions=StandardPermissions(),
        runtime=runtime,
    )
    first = await agent.run("go", session_id="s")
    again = await agent.resume("go", session_id="s")
    assert again.output == first.output
    tool_messages = [m for m in again.messages if m.role == "tool"]
    assert tool_messages[0].is_error
    assert PERMISSION_DENIED == "permission_denied"


deployed: list[tuple[str, bool, int]] = []


def deploy(target: str, force: bool = False, port: int = 80) -> str:
    """Deploy somewhere."""
    deployed.append((target, force, port))
    return "deployed"


@pytest.mark.parametrize(
    "arguments",
    [
        {"target": "s", "force": "TRUE"},
        {"target": "s", "force": "yes"},
        {"target": "s", "force": 1},
        {"target": "s", "port": 22.0},
        {"target": "s", "port": " 22"},
        {"target": "s", "port": "022"},
    ],
)
async def test_an_argument_rule_is_not_dodged_by_a_value_the_tool_coerces(
    arguments: dict[str, Any],
) -> None:
    # The tool receives force=True or port=22 (validation coerces "yes", 1, 22.0, " 22"): a
    # deny rule judged only on the text the model sent let the call run.
    deployed.clear()
    permissions = StandardPermissions(
        "default",
        [
            Rule.deny("deploy", args={"force": "true"}),
            Rule.deny("deploy", args={"port": lambda v: v == 22}),
        ],
    )
    decision = permissions.check(
        ToolCall(id="c", name="deploy", arguments=arguments),
        context=PermissionContext(tool=Tool(deploy)),
    )
    assert decision.behavior == "deny"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return [ToolCall(id="c1", name="deploy", arguments=arguments)]
        return "done"

    agent = Agent("x", model=FunctionModel(decide), tools=[deploy], permissions=permissions)
    events = [e async for e in agent.stream("go")]
    assert deployed == []
    assert [e.final for e in events if isinstance(e, PermissionDecided)] == ["deny"]


def test_one_decision_validates_the_arguments_once_and_only_when_the_sent_ones_do_not_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    validations: list[dict[str, Any]] = []
    tool = Tool(deploy)
    received = tool.received_arguments

    def counted(arguments: Any) -> Any:
        validations.append(dict(arguments))
        return received(arguments)

    monkeypatch.setattr(tool, "received_arguments", counted)
    permissions = StandardPermissions(
        "default",
        [
            Rule.deny("deploy", args={"force": "true"}),
            Rule.deny("deploy", args={"port": "22"}),
            Rule.deny("deploy", when=lambda a: a.get("port") == 22),
        ],
    )
    context = PermissionContext(tool=tool)
    sent = permissions.check(
        ToolCall(id="c", name="deploy", arguments={"target": "prod", "force": True, "port": 22}),
        context=context,
    )
    assert sent.behavior == "deny"
    assert validations == []  # what the model sent decided every rule
    coerced = permissions.check(
        ToolCall(id="c", name="deploy", arguments={"target": "prod", "force": "no", "port": " 22"}),
        context=context,
    )
    assert coerced.behavior == "deny"
    assert len(validations) == 1  # three rules asked, one validation


def test_an_argument_rule_still_judges_what_the_model_sent_when_it_does_not_validate() -> None:
    permissions = StandardPermissions("default", [Rule.deny("deploy", args={"port": "2*"})])
    call = ToolCall(id="c", name="deploy", arguments={"target": "s", "port": "22 ports"})
    context = PermissionContext(tool=Tool(deploy))
    assert permissions.check(call, context=context).behavior == "deny"
    allowed = ToolCall(id="c", name="deploy", arguments={"target": "s", "port": 80})
    assert permissions.check(allowed, context=context).behavior == "allow"


class Target(BaseModel):
    env: str
    force: bool = False


def release(target: Target) -> str:
    """Release to a target."""
    return target.env


def test_predicates_written_for_the_json_the_model_sends_still_work() -> None:
    # The value the tool receives is a Target; a predicate written for the JSON object the
    # model sends sees a mapping either way, and one that cannot read it is no match there.
    permissions = StandardPermissions(
        "default",
        [
            Rule.deny("release", args={"target": lambda v: v["env"] == "prod"}),
            Rule.deny("release", when=lambda a: a["target"].get("force") is True),
        ],
    )
    context = PermissionContext(tool=Tool(release))

    def check(**target: Any) -> str:
        call = ToolCall(id="c", name="release", arguments={"target": target})
        return permissions.check(call, context=context).behavior

    assert check(env="staging") == "allow"
    assert check(env="prod") == "deny"
    assert check(env="staging", force="yes") == "deny"  # the tool reads it as True


class RoleName(enum.Enum):
    VIEWER = "viewer"


@pytest.mark.parametrize(
    ("role", "policy"),
    [
        ({"viewer"}, "role:viewer"),
        (frozenset({"viewer", "other"}), "role:viewer"),
        (RoleName.VIEWER, "error"),
        ([RoleName.VIEWER], "error"),
        (["viewer", 7], "error"),
        ({"viewer": 1}, "error"),
    ],
)
async def test_roles_are_read_from_a_set_and_a_role_that_is_no_name_denies(
    role: Any, policy: str
) -> None:
    # A set of names, an enum member or a list holding one was read as no role at all: the
    # viewer's readOnly did not apply and the tool ran.
    ran.clear()
    permissions = StandardPermissions("bypass", roles={"viewer": Policy(mode="readOnly")})
    _, decided = await run_agent(
        permissions, make_tool(edits=True, destructive=False), metadata={"role": role}
    )
    assert ran == []
    assert [(d.final, d.policy) for d in decided] == [("deny", policy)]
    if policy == "error":
        assert "metadata['role']" in decided[0].reason
        with pytest.raises(UserError, match=r"metadata\['role'\]"):
            PermissionContext.from_metadata({"role": role})


class FailsOnLargeEdits(StandardPermissions):
    """A custom check that raises for the edited arguments only (a policy service that is
    down for them, a bug on a value the model never sent)."""

    def check(self, call: ToolCall, **kwargs: Any) -> Decision:
        if call.arguments.get("record") == "edited":
            raise RuntimeError("policy service down")
        return super().check(call, **kwargs)


async def test_a_check_that_raises_on_edited_arguments_denies_the_call(tmp_path: Any) -> None:
    # The check of the model's call failed closed, but the re-check of the approver's edit
    # let the error escape: the run raised RuntimeError and stayed open, and every resume
    # raised again.
    from loomflow.runtime import SqliteRuntime

    ran.clear()
    permissions = FailsOnLargeEdits(
        approval=lambda request: Approval.edit({"record": "edited"}, by="lead")
    )
    runtime = SqliteRuntime(tmp_path / "journal.db")
    agent = Agent(
        "x",
        model=one_call(),
        tools=[make_tool(edits=False, destructive=True)],
        permissions=permissions,
        runtime=runtime,
    )
    events = [e async for e in agent.stream("go", session_id="s", user_id="u")]
    assert isinstance(events[-1], RunFinished)
    [decided] = [e for e in events if isinstance(e, PermissionDecided)]
    assert ran == []
    assert decided.final == "deny"
    assert "policy service down" in decided.reason
    assert not events[-1].result.interrupted
    assert "permission denied" in events[-1].result.output
    [session] = await runtime.sessions()
    assert session.state == "finished"
    await runtime.close()


async def test_a_call_a_later_hook_rewrites_is_checked_again() -> None:
    # Hooks run after the permission check (hooks= comes last) and may return the call with
    # other arguments; the rewritten call ran without any check: a deny rule on its
    # arguments was got round by a hook that changed them after the check.
    from loomflow.hooks import RunHooks, RunInfo

    class Retarget(RunHooks):
        async def before_tool_call(
            self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Any
        ) -> ToolCall:
            return call.model_copy(update={"arguments": {"record": "prod-db"}})

    ran.clear()
    permissions = StandardPermissions(
        mode="bypass", rules=[Rule.deny("write_record", args={"record": "prod-*"})]
    )
    agent = Agent(
        "x",
        model=one_call(),
        tools=[make_tool(edits=False, destructive=False)],
        permissions=permissions,
        hooks=[Retarget()],
    )
    events = [e async for e in agent.stream("go")]
    assert isinstance(events[-1], RunFinished)
    decided = [e for e in events if isinstance(e, PermissionDecided)]
    assert [(e.final, e.arguments.get("record")) for e in decided] == [
        ("allow", "r1"),
        ("deny", "prod-db"),
    ]
    assert ran == []
    assert "permission denied" in events[-1].result.output


async def test_a_resume_without_metadata_keeps_the_roles_the_run_started_with(
    runtime_factory: Any,
) -> None:
    # agent.resume() without metadata= ran with none: the role a policy denied the call
    # for on the first attempt was gone, so the resumed run ran the call.
    ran.clear()
    crash = [True]

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        results = [m for m in messages if m.role == "tool"]
        if not results:
            return [ToolCall(id="c0", name="write_record", arguments={"record": "a"})]
        if len(results) == 1:
            if crash[0]:
                raise RuntimeError("process died")
            return [ToolCall(id="c1", name="write_record", arguments={"record": "prod-b"})]
        return f"model saw: {results[-1].content}"

    permissions = StandardPermissions(
        mode="bypass",
        roles={"intern": Policy([Rule.deny("write_record", args={"record": "prod-*"})])},
    )
    runtime = await runtime_factory()
    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[make_tool(edits=False, destructive=False)],
        permissions=permissions,
        runtime=runtime,
        name="writer",
    )
    with pytest.raises(RuntimeError):
        await agent.run("go", session_id="s", user_id="u", metadata={"role": "intern"})
    crash[0] = False
    result = await agent.resume("go", session_id="s", user_id="u")
    assert [r["record"] for r in ran] == ["a"]
    assert "permission denied" in result.output


class _Request:
    """A value of the application's own in a run's metadata: the journal cannot encode it."""


@pytest.mark.parametrize(
    "extra", ["sk-ant-api03-" + "k" * 90, _Request()], ids=["secret", "unencodable"]
)
async def test_a_resume_of_a_run_whose_metadata_held_a_secret_needs_its_metadata(
    runtime_factory: Any, extra: object
) -> None:
    # Metadata that held a secret (or a value the journal cannot encode) is not journaled,
    # and agent.resume() without metadata= then ran with none: a viewer's run (readOnly)
    # resumed as a caller without a role, and its edit ran.
    ran.clear()
    crash = [True]

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if not [m for m in messages if m.role == "tool"]:
            if crash[0]:
                raise RuntimeError("process died")
            return [ToolCall(id="c0", name="write_record", arguments={"record": "a"})]
        return "done"

    permissions = StandardPermissions("acceptEdits", roles={"viewer": Policy(mode="readOnly")})
    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[make_tool(edits=True, destructive=False)],
        permissions=permissions,
        runtime=await runtime_factory(),
    )
    metadata = {"role": "viewer", "extra": extra}
    with pytest.raises(RuntimeError):
        await agent.run("go", session_id="s", user_id="u", metadata=metadata)
    crash[0] = False
    with pytest.raises(UserError, match=r"metadata held a secret.*pass metadata= again"):
        await agent.resume("go", session_id="s", user_id="u")
    with pytest.raises(UserError, match="pass metadata= again"):
        await agent.resume("go", session_id="s", user_id="u", approvals={"x": "allow"})
    assert ran == []
    result = await agent.resume("go", session_id="s", user_id="u", metadata=metadata)
    assert ran == []
    assert result.output == "done"


@pytest.mark.parametrize(
    ("record", "error", "says"),
    [
        (b'{"prompt": "go", "metadata": {"$t": "nonsense"}}', UserError, "record is damaged"),
        (b'{"codec_version":2,"prompt":"go"}', NewerEntryError, "newer codec"),
    ],
    ids=["damaged", "newer"],
)
async def test_a_resume_whose_run_record_is_unreadable_does_not_go_on_without_roles(
    tmp_path: Path, record: bytes, error: type[Exception], says: str
) -> None:
    # A damaged run record (a crafted row) read as "no inputs": a resume without metadata=
    # ran the viewer's run as a caller with no role, and its edit ran.
    ran.clear()
    crash = [True]

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if not [m for m in messages if m.role == "tool"]:
            if crash[0]:
                raise RuntimeError("process died")
            return [ToolCall(id="c0", name="write_record", arguments={"record": "a"})]
        return "done"

    path = tmp_path / "journal.db"
    permissions = StandardPermissions("acceptEdits", roles={"viewer": Policy(mode="readOnly")})
    async with SqliteRuntime(path) as runtime:
        agent = Agent(
            "x",
            model=FunctionModel(decide),
            tools=[make_tool(edits=True, destructive=False)],
            permissions=permissions,
            runtime=runtime,
        )
        metadata = {"role": "viewer"}
        with pytest.raises(RuntimeError):
            await agent.run("go", session_id="s", user_id="u", metadata=metadata)
        with sqlite3.connect(path) as db:
            assert db.execute("UPDATE loom_sessions SET record = ?", (record,)).rowcount == 1
        crash[0] = False
        with pytest.raises(error, match=says):
            await agent.resume("go", session_id="s", user_id="u")
        with pytest.raises(error, match=says):
            await agent.resume("go", session_id="s", user_id="u", approvals={"x": "allow"})
        assert ran == []
        # Given its metadata again, the run goes on as the viewer's.
        result = await agent.resume("go", session_id="s", user_id="u", metadata=metadata)
        assert ran == []
        assert result.output == "done"


@pytest.mark.parametrize(
    ("approval", "actor"),
    [
        (lambda request: True, "approver"),
        (lambda request: Approval.deny("no"), "approver"),
        (lambda request: Approval.allow(by="kim"), "approver:kim"),
        (None, "policy:global"),  # nobody was there to ask: the policy's own denial
    ],
    ids=["true", "unnamed-deny", "named", "no-handler"],
)
async def test_an_approver_without_a_name_is_audited_as_an_approver(
    approval: Any, actor: str
) -> None:
    # An approval handler that answered without a name (True, or an Approval without by=)
    # was audited with the actor policy:<policy>, as if the policy had decided.
    from loomflow.audit import AuditLog, InMemoryAuditStore, actions

    ran.clear()
    audit = AuditLog(InMemoryAuditStore())
    agent = Agent(
        "x",
        model=one_call(),
        tools=[make_tool(edits=False, destructive=True)],
        permissions=StandardPermissions(approval=approval),
        audit=audit,
    )
    await agent.run("go", user_id="u")
    [decided] = (await audit.query(user_id="u", action=actions.PERMISSION_DECISION)).entries
    assert decided.actor == actor


def _writes_once(crash: list[bool] | None = None) -> FunctionModel:
    """Calls ``write_record`` once (after a crash while ``crash[0]``), then answers."""

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        results = [m for m in messages if m.role == "tool"]
        if not results:
            if crash is not None and crash[0]:
                raise RuntimeError("process died")
            return [ToolCall(id="c0", name="write_record", arguments={"record": "a"})]
        return f"model saw: {results[-1].content}"

    return FunctionModel(decide)


def _viewer_agent(model: FunctionModel, name: str = "writer") -> Agent:
    return Agent(
        "x",
        model=model,
        tools=[make_tool(edits=True, destructive=False)],
        permissions=StandardPermissions("acceptEdits", roles={"viewer": Policy(mode="readOnly")}),
        name=name,
    )


@pytest.mark.parametrize("architecture", ["workflow", "debate"])
async def test_workflow_and_debate_agents_decide_with_the_runs_roles(architecture: str) -> None:
    # A Workflow's nodes and a Debate's debaters and judge ran with no metadata: a viewer's
    # run (readOnly) had its edits run by every agent of it.
    from loomflow.agent.architectures import Debate, Workflow

    ran.clear()
    if architecture == "workflow":
        run: Any = Workflow([("w", _viewer_agent(_writes_once()))])
    else:
        run = Debate(
            [_viewer_agent(_writes_once(), "pro")], _viewer_agent(_writes_once(), "judge"), rounds=1
        )
    result = await run.run("go", metadata={"role": "viewer"})
    assert ran == []
    assert "permission denied: mode readOnly" in result.output


async def test_a_workflow_resumed_without_metadata_keeps_the_roles_it_started_with(
    runtime_factory: Any,
) -> None:
    # Workflow.resume() without metadata= ran with none, where an agent's resume (and a
    # recoverer) uses the run record's: the viewer's edit ran on the resume.
    from loomflow.agent.architectures import Workflow

    ran.clear()
    crash = [True]
    workflow = Workflow(
        [("w", _viewer_agent(_writes_once(crash)))], runtime=await runtime_factory(), name="p"
    )
    with pytest.raises(RuntimeError):
        await workflow.run("go", session_id="s", user_id="u", metadata={"role": "viewer"})
    crash[0] = False
    result = await workflow.resume("go", session_id="s", user_id="u")
    assert ran == []
    assert "permission denied: mode readOnly" in result.output


async def test_an_agent_run_from_a_tool_decides_with_the_enclosing_runs_roles() -> None:
    # An agent run inside a tool of another run inherited its session and user but not its
    # metadata: the viewer's (readOnly) edit ran in the sub-run.
    ran.clear()
    inner = _viewer_agent(_writes_once(), "inner")

    async def delegate(task: str) -> str:
        """Hand the task to the inner agent."""
        return (await inner.run(task)).output

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        results = [m for m in messages if m.role == "tool"]
        if not results:
            return [ToolCall(id="d0", name="delegate", arguments={"task": "write"})]
        return f"outer saw: {results[-1].content}"

    outer = Agent("x", model=FunctionModel(decide), tools=[Tool(delegate)], name="outer")
    result = await outer.run("go", metadata={"role": "viewer"})
    assert ran == []
    assert "permission denied: mode readOnly" in result.output


def test_an_argument_left_out_is_judged_as_the_default_the_tool_runs_with() -> None:
    # A deny on env="prod" matched only an env the model sent: leaving out an env that
    # defaults to "prod" deployed to prod.
    def deploy(service: str, env: str = "prod", replicas: int = 3) -> str:
        """Deploy a service."""
        return "deployed"

    permissions = StandardPermissions(
        "bypass",
        [
            Rule.deny("deploy", args={"env": "prod"}),
            Rule.deny("deploy", args={"replicas": lambda n: n > 2}),
        ],
    )
    context = PermissionContext(tool=Tool(deploy))

    def check(**arguments: Any) -> str:
        call = ToolCall(id="c", name="deploy", arguments=arguments)
        return permissions.check(call, context=context).behavior

    assert check(service="api", replicas=1) == "deny"  # env left out: "prod"
    assert check(service="api", env="staging") == "deny"  # replicas left out: 3
    assert check(service="api", env="staging", replicas=1) == "allow"
