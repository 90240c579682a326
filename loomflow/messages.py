"""Provider-neutral conversation types: messages, tool calls, usage and stream chunks.

Every class here is a frozen pydantic model registered with the journal codec, because model
calls are journaled: a replayed call hands back exactly the chunks the live call produced, and
freezing them keeps one consumer from editing a value another consumer (or the journal) holds.
They are values all the way down: the journal keeps each instance's encoding (see
:func:`loomflow.runtime.codec.mark_immutable`), so build a new one (``model_copy(update=...)``)
instead of changing a nested dict such as ``ToolCall.arguments`` in place.

A model stream yields :class:`TextDelta` and :class:`ToolCallDelta` chunks while the answer is
being produced, and always ends with the complete :class:`ModelResponse`::

    async for chunk in model.stream(messages, tools=tools, settings=ModelSettings()):
        if isinstance(chunk, TextDelta):
            print(chunk.text, end="")
        elif isinstance(chunk, ModelResponse):
            transcript.append(chunk.to_message())
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .runtime.codec import mark_immutable, print_fast, register_type

__all__ = [
    "Message",
    "ModelChunk",
    "ModelResponse",
    "ModelSettings",
    "OutputFormat",
    "Role",
    "TextDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolSpec",
    "Usage",
]

Role: TypeAlias = Literal["system", "user", "assistant", "tool"]


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


@print_fast
@mark_immutable
@register_type
class ToolCall(_Value):
    """A request from the model to run one tool.

    Attributes:
        id: The provider's call id; a tool result answers it through ``tool_call_id``.
        name: The tool's name.
        arguments: The decoded JSON arguments.
    """

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


MAX_TOKENS_PER_CALL = 10_000_000
"""More tokens than any model reads or writes in one call: a larger count is a bug, not usage."""


@mark_immutable
@register_type
class Usage(_Value):
    """Token counts of one or more model calls. ``Usage() + other`` adds them up.

    Attributes:
        input_tokens: Every input token, prompt-cache reads and writes included (as the
            OpenTelemetry GenAI conventions count them).
        output_tokens: Generated tokens.
        cache_read_tokens: The part of ``input_tokens`` served from the provider's prompt
            cache (billed at a lower rate).
        cache_write_tokens: The part of ``input_tokens`` written to the provider's prompt
            cache (billed at a higher rate by some providers).

    Journal entries written before the cache fields existed decode with both at 0.
    """

    input_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)
    cache_read_tokens: int = Field(default=0, ge=0)
    cache_write_tokens: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check_cache_within_input(self) -> Usage:
        if self.cache_read_tokens + self.cache_write_tokens > self.input_tokens:
            raise ValueError(
                "cache_read_tokens + cache_write_tokens are part of input_tokens and cannot "
                f"exceed it ({self.cache_read_tokens} + {self.cache_write_tokens} > "
                f"{self.input_tokens})"
            )
        return self

    @property
    def total_tokens(self) -> int:
        """Input plus output tokens."""
        return self.input_tokens + self.output_tokens

    @property
    def uncached_input_tokens(self) -> int:
        """Input tokens neither read from nor written to a prompt cache."""
        return self.input_tokens - self.cache_read_tokens - self.cache_write_tokens

    def __add__(self, other: Usage) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cache_read_tokens=self.cache_read_tokens + other.cache_read_tokens,
            cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
        )

    def __radd__(self, other: object) -> Usage:
        # Lets ``sum(usages)`` start from the integer 0.
        if other == 0:
            return self
        return NotImplemented


@print_fast
@mark_immutable
@register_type
class Message(_Value):
    """One entry of a conversation transcript.

    Build them with the helpers, e.g. ``Message.user("hi")`` or
    ``Message.tool_result(call.id, "42", name=call.name)``.

    Attributes:
        role: Who speaks: ``system``, ``user``, ``assistant`` or ``tool``.
        content: The text of the message (a tool result's output for ``tool``).
        tool_calls: The calls an assistant message asks for.
        tool_call_id: For ``tool`` messages, the id of the call this result answers.
        name: For ``tool`` messages, the tool's name.
        is_error: For ``tool`` messages, whether the tool failed or was denied.
    """

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool = False

    @model_validator(mode="after")
    def _check_role_fields(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.role != "tool" and (self.tool_call_id is not None or self.is_error):
            raise ValueError("tool_call_id and is_error belong to tool messages")
        return self

    @classmethod
    def system(cls, content: str) -> Message:
        """Instructions for the model."""
        return cls(role="system", content=content)

    @classmethod
    def user(cls, content: str) -> Message:
        """A turn of the user."""
        return cls(role="user", content=content)

    @classmethod
    def assistant(cls, content: str = "", tool_calls: Iterable[ToolCall] = ()) -> Message:
        """A turn of the model, with the tool calls it asked for."""
        return cls(role="assistant", content=content, tool_calls=list(tool_calls))

    @classmethod
    def tool_result(
        cls, tool_call_id: str, content: str, *, name: str | None = None, is_error: bool = False
    ) -> Message:
        """The output of a tool call, sent back to the model."""
        return cls(
            role="tool", content=content, tool_call_id=tool_call_id, name=name, is_error=is_error
        )


@mark_immutable
@register_type
class ToolSpec(_Value):
    """A tool as the model sees it.

    Attributes:
        name: The name the model calls it by.
        description: What the tool does, for the model.
        parameters: The JSON schema of the arguments object.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


@mark_immutable
@register_type
class ModelSettings(_Value):
    """Sampling settings of a model call.

    Attributes:
        max_tokens: Cap on output tokens.
        temperature: Sampling temperature; ``None`` keeps the provider's default.
    """

    max_tokens: int = Field(default=1024, gt=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)


@mark_immutable
@register_type
class OutputFormat(_Value):
    """The shape a run's final answer must have (``agent.run(..., output_type=...)``).

    Adapters with native structured output send it to the provider (see
    ``docs/structured-output.md``); the answer comes back as JSON text in
    ``ModelResponse.text`` either way.

    Attributes:
        name: A provider-safe name for the shape (letters, digits, ``_`` and ``-``).
        json_schema: The JSON schema of the answer object.
        strict: Whether the schema fits OpenAI's strict mode (every object closed, every
            property required); adapters send ``strict: false`` otherwise.
        description: What the answer is, for the model.
    """

    name: str
    json_schema: dict[str, Any]
    strict: bool = False
    description: str = ""


@mark_immutable
@register_type
class TextDelta(_Value):
    """A piece of the answer's text, in stream order."""

    type: Literal["text_delta"] = "text_delta"
    text: str


@mark_immutable
@register_type
class ToolCallDelta(_Value):
    """A piece of a tool call while it streams.

    The first delta of a call carries its ``id`` and ``name``; later ones append to its JSON
    arguments. ``index`` numbers the calls of one response from 0.
    """

    type: Literal["tool_call_delta"] = "tool_call_delta"
    index: int = Field(ge=0)
    id: str | None = None
    name: str | None = None
    arguments_delta: str = ""


@mark_immutable
@register_type
class ModelResponse(_Value):
    """The complete result of one model call: always the last chunk of a stream.

    Attributes:
        text: The whole answer text.
        tool_calls: The tool calls the model asked for, in order.
        usage: Tokens the call consumed.
        finish_reason: Why generation stopped. Adapters map provider values onto ``stop``,
            ``length``, ``tool_calls`` and ``content_filter``; anything else passes through.
        model: The model id that answered (as the provider reports it).
        usage_reported: Whether the provider reported the call's token counts. ``False``
            when they did not come (an OpenAI-compatible server that ignores
            ``stream_options.include_usage``): ``usage`` then holds only what did come, often
            nothing, and a budget charges the call's whole reservation rather than trusting
            it. Journal entries written before the field existed decode as ``True``.
    """

    type: Literal["response"] = "response"
    text: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    finish_reason: str = "stop"
    model: str = ""
    usage_reported: bool = True

    def to_message(self) -> Message:
        """The assistant message to append to the transcript."""
        return Message.assistant(self.text, self.tool_calls)


ModelChunk: TypeAlias = TextDelta | ToolCallDelta | ModelResponse
