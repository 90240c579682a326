"""Structured output: the final answer validated into a pydantic model (``output_type=``).

The answer is JSON text in ``ModelResponse.text`` whichever way it was obtained: adapters with
native structured output (``native_output = True``) get the :class:`OutputFormat` and make
the provider produce JSON of that shape; any other model gets the schema as an extra system
message. The text is then validated here. An answer that does not validate is answered with
a user message naming the errors, and the model is asked again (``output_retries`` times).

Nothing here is stored: each retry is an ordinary journaled model call whose inputs (the
transcript, the feedback message included) are rebuilt identically on replay, and the parsed
value is always rebuilt by validating the journaled text, never read back from storage.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import json
import re
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any, Protocol, cast

from pydantic import BaseModel, PydanticUserError, ValidationError
from pydantic_core import PydanticSerializationError, to_json

from .._json import canonical_json, unfenced
from ..errors import InvalidArgumentError, InvalidArgumentTypeError, OutputValidationError
from ..messages import Message, ModelChunk, ModelSettings, OutputFormat, ToolSpec
from ..models import Model

__all__ = ["TEXT_OUTPUT", "StructuredOutput", "check_output_type", "contract_digest"]

TEXT_OUTPUT = "text"
"""The output contract of a run without ``output_type`` (see :func:`contract_digest`)."""

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]")
_LOCAL_REF = re.compile(r"^#/\$defs/([^/~]+)$")  # a reference pydantic writes into $defs
# Keys under which a JSON schema nests other schemas.
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "not", "additionalProperties", "contains")
_MAX_ERRORS = 10  # validation errors quoted back to the model
_MAX_ERROR_CHARS = 2000


class _NativeModel(Protocol):
    """A model whose ``stream`` takes the output format (``native_output = True``)."""

    def stream(
        self,
        messages: list[Message],
        *,
        tools: Sequence[ToolSpec],
        settings: ModelSettings,
        output: OutputFormat | None = None,
    ) -> AsyncIterator[ModelChunk]: ...


def check_output_type(output_type: object) -> type[BaseModel]:
    """``output_type`` if it is a pydantic model class, else a typed error naming the problem."""
    if not (isinstance(output_type, type) and issubclass(output_type, BaseModel)):
        raise InvalidArgumentTypeError(
            f"output_type must be a pydantic model class (a BaseModel subclass), not "
            f"{output_type!r}"
        )
    return output_type


def check_output_retries(retries: object) -> int:
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise InvalidArgumentError(f"output_retries must be an int >= 0, not {retries!r}")
    return retries


class StructuredOutput:
    """The output contract of one run: its format, its validation and its retries.

    Args:
        output_type: The pydantic model the final answer must validate into.
        retries: How many more answers to ask for after one fails validation.
        tool_names: The agent's tool names, which the format's name must not shadow (the
            Anthropic adapter offers the format as a tool).
    """

    def __init__(
        self, output_type: type[BaseModel], retries: int, tool_names: Collection[str] = ()
    ) -> None:
        self.type = check_output_type(output_type)
        self.retries = check_output_retries(retries)
        self.format = _format_of(self.type, tool_names)

    @functools.cached_property
    def digest(self) -> str:
        """A digest of the format: what a run record and a checkpoint keep of the contract
        (a class cannot be stored, and decoding never imports one)."""
        shape = canonical_json(self.format.model_dump(mode="json"))
        return hashlib.sha256(shape.encode("utf-8", "surrogatepass")).hexdigest()

    @property
    def step_inputs(self) -> tuple[OutputFormat]:
        """What a model call's journal entry is keyed on besides the transcript."""
        return (self.format,)

    def open_stream(
        self,
        model: Model,
        messages: list[Message],
        tools: list[ToolSpec],
        settings: ModelSettings,
    ) -> AsyncIterator[ModelChunk]:
        """The model's stream, asked for an answer of this format."""
        if getattr(model, "native_output", False) is True:
            native = cast(_NativeModel, model)
            return native.stream(messages, tools=tools, settings=settings, output=self.format)
        return model.stream(self.with_instructions(messages), tools=tools, settings=settings)

    def with_instructions(self, messages: list[Message]) -> list[Message]:
        """``messages`` with the schema stated after the system prompt (non-native models)."""
        schema = json.dumps(self.format.json_schema, ensure_ascii=False, sort_keys=True)
        note = Message.system(
            f"Give your final answer as one JSON object, and nothing else (no prose, no code "
            f"fences), that validates against this JSON schema: {schema}"
        )
        head = 1 if messages and messages[0].role == "system" else 0
        return [*messages[:head], note, *messages[head:]]

    def validate(self, text: str) -> BaseModel:
        """The answer ``text`` validated into the output type (pydantic's error if not)."""
        return self.type.model_validate_json(unfenced(text))

    def retry_message(
        self, messages: Sequence[Message], prompt_index: int, *, at_limit: bool = False
    ) -> Message | None:
        """What to ask the model next if the last answer does not validate, else ``None``.

        The answers refused so far are counted in ``messages`` (the retry requests after the
        run's prompt, at ``prompt_index``), so a replayed or restored run counts exactly what
        the first one did. An answer cut at the output-token limit (``at_limit``) is not
        retried: asked again under the same limit, the model is cut again, and each retry
        pays for the limit's worth of tokens.

        Raises:
            OutputValidationError: the answer does not validate and no retry is left.
        """
        answer = messages[-1].content if messages else ""
        try:
            self.validate(answer)
        except ValidationError as exc:
            detail = _describe(exc)
            refused = self._requests_since_prompt(messages, prompt_index) + 1
            if refused > self.retries or at_limit:
                raise OutputValidationError(self.type.__name__, detail, refused, answer) from None
            return Message.user(
                f"{self._retry_prefix} {detail}\nReply again with only the corrected JSON object."
            )
        return None

    @property
    def _retry_prefix(self) -> str:
        return f"Your answer is not a valid {self.format.name} object:"

    def _requests_since_prompt(self, messages: Sequence[Message], prompt_index: int) -> int:
        """The retry requests the loop added after the prompt.

        Only messages after ``prompt_index`` count: the prompt, or a message of the history
        before it, may begin with the same words (a user quoting an earlier exchange), and
        the request text itself stays as it is, since it is part of the journaled transcript
        (the model calls' keys). A forked run's ``prompt_index`` points at the start of its
        history rather than at its prompt, so the count also stops at the first user message
        that is not a request: what the loop adds after the prompt is never such a message.
        """
        count = 0
        for message in reversed(messages[prompt_index + 1 :]):
            if message.role != "user":
                continue
            if not message.content.startswith(self._retry_prefix):
                break  # the prompt, in a forked run
            count += 1
        return count

    def parse(self, text: str) -> BaseModel:
        """The final answer, validated (after the output guardrails had their say)."""
        try:
            return self.validate(text)
        except ValidationError as exc:
            raise OutputValidationError(self.type.__name__, _describe(exc), 1, text) from None


def contract_digest(structured: StructuredOutput | None) -> str:
    """The output contract a checkpoint records: the format's digest, or :data:`TEXT_OUTPUT`.

    The format is an input of every model call of the run (:attr:`StructuredOutput.step_inputs`),
    so a run under another contract replays none of them; a snapshot taken under another
    contract must not be restored either (see ``_run.contract_mismatch``).
    """
    return TEXT_OUTPUT if structured is None else structured.digest


def _format_of(output_type: type[BaseModel], tool_names: Collection[str]) -> OutputFormat:
    try:
        # Written as JSON data: pydantic leaves json_schema_extra values (a date, a Decimal
        # among the examples) as given, and a default of inf or NaN as a float, which no
        # provider's request body takes. Those become the text pydantic parses back.
        raw = to_json(output_type.model_json_schema(), inf_nan_mode="strings")
        schema = _root_resolved(json.loads(raw))
    except (PydanticUserError, PydanticSerializationError) as exc:
        # A field pydantic can validate but not describe (an arbitrary class with
        # arbitrary_types_allowed, a forward reference never defined): no provider could be
        # told the shape, so the type is refused before anything runs.
        reason = str(exc).split("\n", 1)[0]
        raise InvalidArgumentError(
            f"output_type {output_type.__name__} has no JSON schema to ask the model for: {reason}"
        ) from exc
    if schema.get("type") != "object":
        raise InvalidArgumentError(
            f"output_type {output_type.__name__} must validate a JSON object (a model with "
            f"fields); its schema is of type {schema.get('type')!r}"
        )
    strict_schema = _strict_schema(schema)
    name = _NAME_CHARS.sub("_", output_type.__name__)[:50] or "output"
    while name in tool_names:
        name = f"{name}_output"[-64:]
    doc = inspect.getdoc(output_type) if output_type.__doc__ else None
    return OutputFormat(
        name=name,
        json_schema=strict_schema if strict_schema is not None else schema,
        strict=strict_schema is not None,
        description=doc or f"The final answer, as a {name} object.",
    )


def _root_resolved(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with a top-level ``$ref`` into its own ``$defs`` replaced by its target.

    Pydantic describes a recursive model (a field of its own type) as ``{"$defs": {"Node":
    {...}}, "$ref": "#/$defs/Node"}``. Providers want an object schema at the top (Anthropic's
    tool ``input_schema``, OpenAI's response format), so the definition is copied up while
    ``$defs`` stays, and the nested ``#/$defs/Node`` references still resolve. Any other
    schema is returned unchanged (so are the journal keys of the types that worked before).
    """
    ref = schema.get("$ref")
    defs = schema.get("$defs")
    match = _LOCAL_REF.match(ref) if isinstance(ref, str) else None
    if match is None or not isinstance(defs, dict):
        return schema
    target = defs.get(match.group(1))
    if not isinstance(target, dict):
        return schema
    siblings = {k: v for k, v in schema.items() if k not in ("$ref", "$defs")}
    return {**copy.deepcopy(target), **siblings, "$defs": defs}


def _strict_schema(schema: dict[str, Any]) -> dict[str, Any] | None:
    """``schema`` in the form OpenAI's strict mode takes, or ``None`` if it has none.

    Strict mode wants every object closed (``additionalProperties: false``) with every
    property required. Closing an object a pydantic model describes changes nothing (extra
    keys are ignored anyway), so that is added; a field with a default (not required) or a
    free-form mapping (``dict[str, X]``) has no strict form, and the schema goes as it is.
    """
    out = copy.deepcopy(schema)
    return out if _close_objects(out) else None


def _close_objects(node: Any) -> bool:
    if isinstance(node, list):
        return all(_close_objects(item) for item in node)
    if not isinstance(node, dict):
        return True
    if node.get("type") == "object" or "properties" in node:
        properties = node.get("properties")
        extra = node.get("additionalProperties", False)
        if not isinstance(properties, dict) or extra is not False:
            return False
        if set(node.get("required", ())) != set(properties):
            return False
        node["additionalProperties"] = False
    ok = True
    for key in _SUBSCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            ok = ok and all(_close_objects(v) for v in value.values())
    for key in (*_SUBSCHEMA_LISTS, *_SUBSCHEMA_ONE):
        value = node.get(key)
        if isinstance(value, dict | list):
            ok = ok and _close_objects(value)
    return ok


def _describe(exc: ValidationError) -> str:
    """Pydantic's errors as one line each, without links (stable across pydantic releases)."""
    lines = []
    for error in exc.errors(include_url=False)[:_MAX_ERRORS]:
        where = ".".join(str(part) for part in error["loc"]) or "(the answer)"
        lines.append(f"{where}: {error['msg']}")
    more = exc.error_count() - _MAX_ERRORS
    if more > 0:
        lines.append(f"... and {more} more error(s)")
    return "; ".join(lines)[:_MAX_ERROR_CHARS]
