"""JSON schemas and descriptions built from signatures, hints and docstrings."""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Any, Literal, Optional

import pytest
from pydantic import BaseModel, Field

from loomflow import RunContext
from loomflow.errors import UserError
from loomflow.tools import Tool, as_tool, tool


class Address(BaseModel):
    street: str
    postcode: str | None = None


@dataclasses.dataclass
class Window:
    start: int
    end: int


def props(t: Tool[..., Any]) -> dict[str, Any]:
    properties: dict[str, Any] = t.parameters["properties"]
    return properties


def test_primitives_are_required_and_typed() -> None:
    @tool
    def f(s: str, i: int, x: float, b: bool) -> None:
        """Primitives."""

    assert f.parameters == {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "x": {"type": "number"},
            "b": {"type": "boolean"},
        },
        "required": ["s", "i", "x", "b"],
        "additionalProperties": False,
    }


def test_optional_list_literal_and_defaults() -> None:
    @tool
    def f(
        a: Optional[int],  # noqa: UP045 - the spelling under test
        b: int | None = None,
        ids: list[int] | None = None,
        mode: Literal["fast", "slow"] = "fast",
        n: int = 3,
    ) -> None:
        """Mixed."""

    p = props(f)
    assert p["a"] == {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    assert p["b"] == {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}
    assert p["ids"]["anyOf"][0] == {"type": "array", "items": {"type": "integer"}}
    assert p["mode"] == {"enum": ["fast", "slow"], "type": "string", "default": "fast"}
    assert p["n"] == {"type": "integer", "default": 3}
    # Optional without a default is still required: the signature demands a value.
    assert f.parameters["required"] == ["a"]


def test_plain_list_and_dict_arguments() -> None:
    @tool
    def f(xs: list[int], tags: dict[str, str]) -> None:
        """Containers."""

    assert props(f)["xs"] == {"type": "array", "items": {"type": "integer"}}
    assert props(f)["tags"] == {"type": "object", "additionalProperties": {"type": "string"}}


def test_pydantic_model_and_dataclass_arguments_use_defs() -> None:
    @tool
    def f(to: Address, window: Window) -> None:
        """Nested."""

    schema = f.parameters
    assert schema["properties"]["to"] == {"$ref": "#/$defs/Address"}
    assert schema["properties"]["window"] == {"$ref": "#/$defs/Window"}
    assert schema["$defs"]["Address"]["required"] == ["street"]
    assert set(schema["$defs"]["Window"]["properties"]) == {"start", "end"}


def test_docstring_gives_description_and_argument_descriptions() -> None:
    @tool
    def get_weather(city: str, days: int = 1) -> str:
        """Get the forecast
        for a city.

        Longer explanation that the model does not need.

        Args:
            city: Name of the city, e.g. "Oslo".
            days: Number of days,
                between 1 and 10.
        """
        return ""

    assert get_weather.name == "get_weather"
    assert get_weather.description == "Get the forecast for a city."
    assert props(get_weather)["city"] == {
        "type": "string",
        "description": 'Name of the city, e.g. "Oslo".',
    }
    assert props(get_weather)["days"]["description"] == "Number of days, between 1 and 10."


def test_annotated_field_description_wins_over_docstring() -> None:
    @tool
    def f(n: Annotated[int, Field(description="explicit", ge=0)]) -> None:
        """F.

        Args:
            n: from the docstring
        """

    assert props(f)["n"] == {"type": "integer", "description": "explicit", "minimum": 0}


def test_field_default_is_honoured() -> None:
    @tool
    def f(n: int = Field(5, description="count", le=9)) -> None:
        """F."""

    assert props(f)["n"] == {"type": "integer", "default": 5, "description": "count", "maximum": 9}
    assert "required" not in f.parameters


def test_no_titles_and_no_arguments() -> None:
    @tool
    def ping() -> str:
        return "pong"

    assert ping.parameters == {"type": "object", "properties": {}, "additionalProperties": False}
    assert ping.description == ""


def test_names_that_clash_with_pydantic_are_fine() -> None:
    @tool
    def f(json: str, copy: int, _id: str, model_config: str) -> None:
        """Awkward names."""

    assert list(props(f)) == ["json", "copy", "_id", "model_config"]


def test_unannotated_parameter_accepts_anything() -> None:
    @tool
    def f(x, y: int = 0):  # type: ignore[no-untyped-def]
        """Loose."""

    assert props(f)["x"] == {}


def test_run_context_parameters_are_hidden() -> None:
    @tool
    def f(query: str, ctx: RunContext, maybe: RunContext | None = None) -> None:
        """Uses the context."""

    assert list(props(f)) == ["query"]
    assert f.parameters["required"] == ["query"]


def test_local_types_resolve_under_future_annotations() -> None:
    class Item(BaseModel):
        sku: str

    @tool
    def f(item: Item) -> None:
        """Local model."""

    assert f.parameters["$defs"]["Item"]["properties"] == {"sku": {"type": "string"}}


def test_spec_is_plain_and_a_copy() -> None:
    @tool(name="lookup", description="Find a thing.")
    def f(q: str) -> None:
        """Ignored docstring."""

    spec = f.spec()
    assert spec == {"name": "lookup", "description": "Find a thing.", "parameters": f.parameters}
    spec["parameters"]["properties"].clear()
    assert props(f) == {"q": {"type": "string"}}


def test_bound_methods_and_partials() -> None:
    class Shop:
        def price(self, sku: str) -> int:
            """Price of a SKU."""
            return 1

    method_tool = as_tool(Shop().price)
    assert method_tool.name == "price"
    assert list(props(method_tool)) == ["sku"]

    def scaled(x: int, factor: int) -> int:
        return x * factor

    double = Tool(functools.partial(scaled, factor=2), name="double")
    assert double(x=4) == 8
    assert double.__name__ == "double"
    assert list(props(double)) == ["x", "factor"]
    assert props(double)["factor"]["default"] == 2


def test_unsupported_signatures_are_user_errors() -> None:
    def star(*values: int) -> None: ...

    def kw(**values: int) -> None: ...

    def gen() -> Any:
        yield 1

    class Opaque:
        pass

    def opaque(x: Opaque) -> None: ...

    for fn in (star, kw, gen, opaque):
        with pytest.raises(UserError):
            tool(fn)


def test_unresolvable_hint_is_a_user_error() -> None:
    def f(x: DoesNotExist) -> None:  # type: ignore[name-defined]  # noqa: F821
        ...

    with pytest.raises(UserError, match="type hints"):
        tool(f)
