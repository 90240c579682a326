"""Decorator options, coercion of plain functions, the registry and the public surface."""

from __future__ import annotations

import pytest

import loomflow.tools
from loomflow.errors import UserError
from loomflow.tools import Tool, ToolRegistry, Toolset, as_tool, tool


def lookup(order_id: str) -> str:
    """Find an order."""
    return order_id


@tool
def refund(order_id: str, card_number: str, cents: int) -> str:
    """Refund an order."""
    return "ok"


# --- options -------------------------------------------------------------------------------


def test_bare_decorator_defaults() -> None:
    assert isinstance(refund, Tool)
    assert refund.name == "refund"
    assert refund.description == "Refund an order."
    assert refund.timeout is None
    assert refund.destructive is False
    assert refund.edits is False
    assert refund.sensitive == frozenset()
    assert refund.is_async is False
    assert refund.fn("o", "c", 1) == "ok"


def test_decorator_options() -> None:
    @tool(
        name="issue_refund",
        description="Refund money.",
        timeout=2.5,
        destructive=True,
        edits=True,
        sensitive=["card_number"],
    )
    async def f(order_id: str, card_number: str) -> str:
        return order_id

    assert f.name == "issue_refund"
    assert f.description == "Refund money."
    assert f.timeout == 2.5
    assert f.destructive
    assert f.edits
    assert f.sensitive == frozenset({"card_number"})
    assert f.is_async
    assert repr(f) == "Tool(name='issue_refund', destructive=True, edits=True)"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sensitive": ("card",)}, r"sensitive names \['card'\] are not arguments"),
        ({"sensitive": "card_number"}, "collection of argument names"),
        ({"timeout": 0}, "timeout must be positive"),
        ({"timeout": -1.0}, "timeout must be positive"),
        ({"timeout": "5"}, "timeout must be a number of seconds, not '5'"),
        ({"timeout": True}, "timeout must be a number of seconds, not True"),
        ({"timeout": float("nan")}, "timeout must be positive"),
        ({"name": "has space"}, "is not usable"),
        ({"name": "x" * 65}, "is not usable"),
        # Flags read from a config file: "false" was a destructive tool, "" an unsealed result.
        ({"destructive": "false"}, "destructive must be True or False, not 'false'"),
        ({"edits": 1}, "edits must be True or False, not 1"),
        ({"sensitive_result": ""}, "sensitive_result must be True or False, not ''"),
        ({"blocking": "no"}, "blocking must be True, False or None, not 'no'"),
    ],
)
def test_bad_options_are_user_errors(options: dict[str, object], message: str) -> None:
    def f(order_id: str, card_number: str) -> None: ...

    with pytest.raises(UserError, match=message):
        tool(**options)(f)  # type: ignore[call-overload]


def test_lambdas_need_a_name() -> None:
    with pytest.raises(UserError, match="pass name="):
        tool(lambda: 1)
    assert tool(name="one")(lambda: 1).name == "one"


def test_non_functions_are_rejected() -> None:
    with pytest.raises(UserError, match="must wrap a function"):
        Tool(42)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="must wrap a function"):
        tool(ToolRegistry)
    with pytest.raises(UserError, match="already a Tool"):
        tool(refund)


# --- as_tool -------------------------------------------------------------------------------


def test_as_tool_wraps_functions_and_passes_tools_through() -> None:
    wrapped = as_tool(lookup)
    assert isinstance(wrapped, Tool)
    assert wrapped.name == "lookup"
    assert wrapped("A1") == "A1"
    assert as_tool(refund) is refund


# --- registry ------------------------------------------------------------------------------


def test_registry_is_a_mapping_of_names() -> None:
    registry = ToolRegistry([refund, lookup])
    assert list(registry) == ["refund", "lookup"]
    assert len(registry) == 2
    assert registry["refund"] is refund
    assert isinstance(registry["lookup"], Tool)
    assert "lookup" in registry
    assert [s["name"] for s in registry.specs()] == ["refund", "lookup"]
    assert repr(registry) == "ToolRegistry(['refund', 'lookup'])"


def test_duplicate_names_are_rejected_clearly() -> None:
    @tool(name="lookup")
    def other(order_id: str) -> str:
        return ""

    registry = ToolRegistry([lookup])
    with pytest.raises(UserError) as excinfo:
        registry.add(other)
    message = str(excinfo.value)
    assert "two tools are named 'lookup'" in message
    assert "test_tool_registry.lookup" in message
    assert "other" in message
    assert "@tool(name=...)" in message
    with pytest.raises(UserError, match="registered twice"):
        ToolRegistry([lookup, lookup])  # two separate wrappers of one function


def test_adding_the_same_tool_twice_is_harmless() -> None:
    registry = ToolRegistry([refund])
    assert registry.add(refund) is refund
    assert len(registry) == 1


async def test_registry_invoke_and_unknown_names() -> None:
    registry = Toolset([lookup])
    assert (await registry.invoke("lookup", {"order_id": "Z9"})).value == "Z9"
    outcome = await registry.invoke("lookup_order", {"order_id": "Z9"})
    assert not outcome.ok
    assert outcome.error_type == "unknown_tool"
    assert outcome.error == "there is no tool named 'lookup_order' (available tools: lookup)"


def test_toolset_is_the_registry() -> None:
    assert Toolset is ToolRegistry


def test_public_surface() -> None:
    assert loomflow.tools.__all__ == sorted(loomflow.tools.__all__)
    for name in loomflow.tools.__all__:
        assert getattr(loomflow.tools, name) is not None
    assert {"tool", "Tool", "ToolOutcome", "ToolRegistry", "as_tool"} <= set(loomflow.tools.__all__)
