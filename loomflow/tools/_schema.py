"""From a Python signature to a JSON schema and back to call arguments.

Each exposed parameter becomes a field of a generated pydantic model. Fields are stored under
synthetic names (``p0``, ``p1``...) with the parameter name as their alias: a parameter may
then be called ``json``, ``copy`` or ``_id`` without clashing with ``BaseModel`` attributes
or pydantic's private-name rules, and the model still sees the real names.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import NoneType, UnionType
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PydanticUserError, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import ErrorDetails, PydanticSerializationError

from ..context import RunContext
from ..errors import UserError
from ._docstring import Docstring

__all__ = ["ArgumentBinder", "InvalidArgumentsError", "build_binder"]


class InvalidArgumentsError(ValueError):
    """Arguments from the model do not fit the tool's signature (never leaves this package)."""


class _NoFieldTitles(GenerateJsonSchema):
    # Field titles are the parameter names again in Title Case; they cost model tokens and
    # tell it nothing. Titles of nested models ($defs) are class names and are kept.
    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class _Slot:
    name: str
    field: str | None  # None: a RunContext parameter, filled in by the framework
    positional_only: bool


@dataclass(frozen=True, slots=True)
class ArgumentBinder:
    """Validates model-supplied arguments and turns them into a Python call.

    Attributes:
        model: The generated pydantic model holding one field per exposed parameter.
        schema: The JSON schema of ``model``, as sent to the language model.
        slots: Every parameter of the function, in signature order.
    """

    model: type[BaseModel]
    schema: dict[str, Any]
    slots: tuple[_Slot, ...]

    @property
    def exposed(self) -> tuple[str, ...]:
        """Names of the parameters the language model fills in."""
        return tuple(s.name for s in self.slots if s.field is not None)

    def bind(
        self, arguments: Mapping[str, Any] | None, context: RunContext
    ) -> tuple[list[Any], dict[str, Any]]:
        """Validate ``arguments`` and build positional and keyword arguments for the call.

        Raises:
            InvalidArgumentsError: with one readable line per problem.
        """
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            raise InvalidArgumentsError(
                f"arguments must be a JSON object, got {type(arguments).__name__}"
            )
        try:
            validated = self.model.model_validate(dict(arguments))
        except ValidationError as exc:
            raise InvalidArgumentsError(self._explain(exc.errors())) from None

        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        given = validated.model_fields_set
        for slot in self.slots:
            if slot.field is None:
                value: Any = context
            elif slot.positional_only or slot.field in given:
                value = getattr(validated, slot.field)
            else:
                # Not supplied: let Python apply the default itself, so sentinel and
                # mutable defaults behave exactly as in a direct call.
                continue
            if slot.positional_only:
                args.append(value)
            else:
                kwargs[slot.name] = value
        return args, kwargs

    def received(self, arguments: Mapping[str, Any]) -> dict[str, Any] | None:
        """The given arguments as the function receives them (validated, so coerced: ``"yes"``
        becomes ``True``; left out, the default), by name; ``None`` when they do not validate
        (nothing then runs)."""
        try:
            validated = self.model.model_validate(dict(arguments))
        except ValidationError:
            return None
        # Nested models as mappings, as the model sent them, so that a rule's predicate
        # written for that JSON can read them.
        try:
            received = validated.model_dump(by_alias=True, exclude_unset=True, round_trip=True)
        except (PydanticSerializationError, TypeError, ValueError):
            return None  # a value pydantic cannot copy out: what the model sent is judged
        # An argument left out runs with its default: judged as that too, so that leaving out
        # an env that defaults to "prod" does not dodge a deny on env="prod". A default that
        # cannot be copied out is left unjudged, as before.
        unset = set(type(validated).model_fields) - validated.model_fields_set
        if unset:
            try:
                defaults = validated.model_dump(by_alias=True, include=unset, round_trip=True)
            except (PydanticSerializationError, TypeError, ValueError):
                defaults = {}
            received = {**defaults, **received}
        return received

    def _explain(self, errors: list[ErrorDetails]) -> str:
        problems: list[str] = []
        unexpected = False
        for err in errors:
            loc = err["loc"]
            where = _format_loc(loc)
            if err["type"] == "missing" and len(loc) == 1:
                problems.append(f"missing required argument {where!r}")
            elif err["type"] == "extra_forbidden" and len(loc) == 1:
                unexpected = True
                problems.append(f"unexpected argument {where!r}")
            else:
                problems.append(f"argument {where!r}: {err['msg']} (got {_short(err['input'])})")
        text = "; ".join(problems)
        if unexpected:
            accepted = ", ".join(self.exposed) or "none"
            text += f" (accepted arguments: {accepted})"
        return text


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _is_context(hint: Any) -> bool:
    if hint is RunContext:
        return True
    # `ctx: RunContext | None` is also injected: there is always a context, maybe empty.
    if typing.get_origin(hint) in (typing.Union, UnionType):
        members = [a for a in typing.get_args(hint) if a is not NoneType]
        return members == [RunContext]
    return False


def _has_own_description(hint: Any) -> bool:
    if typing.get_origin(hint) is not Annotated:
        return False
    return any(isinstance(m, FieldInfo) and m.description is not None for m in hint.__metadata__)


def _hint_target(fn: Callable[..., Any]) -> Any:
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    if not (inspect.isfunction(target) or inspect.ismethod(target)) and callable(target):
        target = type(target).__call__  # an instance with __call__: hints live on the method
    return target


def _type_hints(fn: Callable[..., Any], localns: Mapping[str, Any] | None) -> dict[str, Any]:
    target = _hint_target(fn)
    try:
        try:
            return typing.get_type_hints(target, include_extras=True)
        except NameError:
            # A type defined inside a function is visible only in that function's locals,
            # which the decorator captured; globals are tried first so that an unrelated
            # local variable can never shadow a module-level type.
            if localns is None:
                raise
            return typing.get_type_hints(target, localns=dict(localns), include_extras=True)
    except Exception as exc:
        raise UserError(
            f"cannot resolve the type hints of {_qualname(fn)}: {exc}; define the types it "
            "uses at module level or import them where the function is defined"
        ) from exc


def _qualname(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def build_binder(
    fn: Callable[..., Any], doc: Docstring, localns: Mapping[str, Any] | None = None
) -> ArgumentBinder:
    """Build the argument model and JSON schema of ``fn``.

    Args:
        fn: The tool function.
        doc: Its parsed docstring, whose ``Args:`` entries become field descriptions.
        localns: Extra names for resolving string annotations (the decorating frame's locals).

    Raises:
        UserError: when the signature cannot be described to a model.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise UserError(f"cannot read the signature of {_qualname(fn)}: {exc}") from exc
    hints = _type_hints(fn, localns)

    fields: dict[str, Any] = {}
    slots: list[_Slot] = []
    for index, param in enumerate(signature.parameters.values()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise UserError(
                f"{_qualname(fn)}: *{param.name} / **{param.name} cannot be described to a "
                "model; declare each argument as a named parameter"
            )
        positional_only = param.kind is param.POSITIONAL_ONLY
        hint = hints.get(param.name, Any)
        if _is_context(hint):
            slots.append(_Slot(param.name, None, positional_only))
            continue
        field_name = f"p{index}"
        fields[field_name] = (_annotate(hint, param.name, doc), _default(param))
        slots.append(_Slot(param.name, field_name, positional_only))

    try:
        model = create_model(
            "ToolArguments",
            __config__=ConfigDict(extra="forbid", protected_namespaces=()),
            **fields,
        )
        schema = model.model_json_schema(schema_generator=_NoFieldTitles)
    except PydanticUserError as exc:
        raise UserError(
            f"{_qualname(fn)}: its parameters cannot be turned into a JSON schema ({exc}); "
            "use JSON-like types, pydantic models or dataclasses"
        ) from exc
    schema.pop("title", None)
    return ArgumentBinder(model=model, schema=schema, slots=tuple(slots))


def _annotate(hint: Any, name: str, doc: Docstring) -> Any:
    """Attach the alias and the docstring description to ``hint``.

    The docstring description goes first in the ``Annotated`` metadata so that an explicit
    ``Annotated[..., Field(description=...)]`` written by the user overrides it.
    """
    base, extra = hint, ()
    if typing.get_origin(hint) is Annotated:
        base, extra = hint.__origin__, hint.__metadata__
    metadata: list[Any] = []
    description = doc.params.get(name)
    if description and not _has_own_description(hint):
        metadata.append(Field(description=description))
    metadata.extend(extra)
    metadata.append(Field(alias=name))
    return Annotated[(base, *metadata)]


def _default(param: inspect.Parameter) -> Any:
    # A `= Field(...)` default is kept as is: pydantic merges it with the Annotated metadata.
    return ... if param.default is param.empty else param.default
