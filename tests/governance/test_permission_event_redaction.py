"""The arguments of a PermissionDecided event, which every in-process hook receives, are
hidden as the audit log's permission.decision entry hides them (never shown more)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from loomflow.agent import Agent
from loomflow.agent.hooks import RunHooks, RunInfo
from loomflow.audit import AuditLog
from loomflow.governance import (
    Approval,
    ApprovalRequest,
    PermissionDecided,
    StandardPermissions,
)
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.tools import Tool

ARGUMENTS = {"host": "db1", "db_password": "hunter2x", "owner_email": "ana@corp.com"}
ran: list[dict[str, Any]] = []


def connect(host: str, db_password: str, owner_email: str) -> str:
    """Connect to a database."""
    ran.append({"host": host, "db_password": db_password, "owner_email": owner_email})
    return "connected"


class Watch(RunHooks):
    """A hook as an exporter or log shipper writes one."""

    def __init__(self) -> None:
        self.decided: list[PermissionDecided] = []
        self.before: list[dict[str, Any]] = []

    async def before_tool_call(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Any
    ) -> ToolCall:
        self.before.append(dict(call.arguments))
        return call

    async def on_event(self, info: RunInfo, event: BaseModel) -> None:
        if isinstance(event, PermissionDecided):
            self.decided.append(event)


def calling(name: str) -> FunctionModel:
    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if not any(m.role == "tool" for m in messages):
            return [ToolCall(id="c", name=name, arguments=dict(ARGUMENTS))]
        return "done"

    return FunctionModel(decide)


async def decided_and_audited(
    tmp_path: Path, tool: Tool[..., Any], name: str, permissions: StandardPermissions
) -> tuple[Watch, dict[str, Any]]:
    watch = Watch()
    audit = AuditLog(f"sqlite:///{tmp_path / 'audit.db'}")
    agent = Agent(
        "x",
        model=calling(name),
        tools=[tool],
        permissions=permissions,
        hooks=[watch],
        audit=audit,
    )
    await agent.run("go", user_id="ana")
    page = await audit.query(user_id="ana", action="permission.decision")
    [entry] = page.entries
    return watch, entry.payload["arguments"]


async def test_values_under_secret_keys_and_personal_data_are_hidden_as_in_the_audit(
    tmp_path: Path,
) -> None:
    ran.clear()
    watch, audited = await decided_and_audited(
        tmp_path, Tool(connect), "connect", StandardPermissions()
    )
    [event] = watch.decided
    # Neither declared sensitive: the key names a secret, the value is an e-mail address.
    assert event.arguments == {
        "host": "db1",
        "db_password": "[REDACTED]",
        "owner_email": "[REDACTED:email]",
    }
    assert event.arguments == audited
    # What a hook needs to act on the call it has before the call runs, as the tool gets it.
    assert ran == [ARGUMENTS]
    assert ARGUMENTS in watch.before


async def test_an_approvers_edit_is_hidden_the_same_way(tmp_path: Path) -> None:
    ran.clear()

    def edit(request: ApprovalRequest) -> Approval:
        return Approval.edit({**request.call.arguments, "owner_email": "kim@corp.com"}, by="lead")

    watch, audited = await decided_and_audited(
        tmp_path,
        Tool(connect, destructive=True),
        "connect",
        StandardPermissions(approval=edit),
    )
    [event] = watch.decided
    assert (event.edited, event.final) == (True, "allow")
    assert event.arguments["owner_email"] == "[REDACTED:email]"
    assert event.arguments["db_password"] == "[REDACTED]"
    assert event.arguments == audited
    assert ran == [{**ARGUMENTS, "owner_email": "kim@corp.com"}]


async def test_a_tool_that_does_not_exist_shows_no_value(tmp_path: Path) -> None:
    # Nothing says which of a made-up tool's arguments are secret: none is shown, as in
    # its audit entries.
    watch, audited = await decided_and_audited(
        tmp_path, Tool(connect), "no_such_tool", StandardPermissions()
    )
    [event] = watch.decided
    assert event.arguments == dict.fromkeys(ARGUMENTS, "[REDACTED]")
    assert event.arguments == audited
