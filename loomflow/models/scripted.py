"""Deterministic models for tests, demos and examples: no network, no randomness.

:class:`ScriptedModel` plays back a fixed list of turns; :class:`FunctionModel` answers with a
function of the conversation. Both stream like a real model (text in a few deltas, one delta per
tool call, then the :class:`~loomflow.messages.ModelResponse`), count tokens with a fixed rule,
and count their calls, so a test can assert that a resumed run made no model call at all::

    model = ScriptedModel([[ToolCall(id="c1", name="add", arguments={"a": 1, "b": 2})], "3"])
    ...
    assert model.calls == 2
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeAlias

from ..errors import ScriptExhaustedError
from ..messages import (
    Message,
    ModelChunk,
    ModelResponse,
    ModelSettings,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    Usage,
)

__all__ = [
    "FunctionModel",
    "FunctionResult",
    "ScriptTurn",
    "ScriptedModel",
    "approx_tokens",
    "echo_last_user",
]

ScriptTurn: TypeAlias = str | ModelResponse | Sequence[ToolCall] | BaseException
"""One scripted answer: final text, a full response, the tool calls of a tool-use turn, or an
exception to raise (to test failure paths)."""

FunctionResult: TypeAlias = str | ModelResponse | Sequence[ToolCall]
"""What a :class:`FunctionModel` function returns."""

_WORDS = re.compile(r"\S+\s*|\s+")
_WORDS_PER_DELTA = 3


def approx_tokens(text: str) -> int:
    """A deterministic token estimate: one token per four characters, rounded up."""
    return (len(text) + 3) // 4


def _message_tokens(message: Message) -> int:
    calls = "".join(c.name + json.dumps(c.arguments, sort_keys=True) for c in message.tool_calls)
    return approx_tokens(message.content) + approx_tokens(calls)


def echo_last_user(messages: Sequence[Message]) -> str:
    """The default answer of ``resolve_model("scripted")``: echoes the last user message."""
    for message in reversed(messages):
        if message.role == "user":
            return f"Echo: {message.content}"
    return "Echo: (no user message)"


def _build_response(
    answer: FunctionResult, messages: Sequence[Message], model_name: str
) -> ModelResponse:
    if isinstance(answer, ModelResponse):
        return answer
    input_tokens = sum(_message_tokens(m) for m in messages)
    if isinstance(answer, str):
        return ModelResponse(
            text=answer,
            usage=Usage(input_tokens=input_tokens, output_tokens=approx_tokens(answer)),
            finish_reason="stop",
            model=model_name,
        )
    calls = list(answer)
    if not all(isinstance(c, ToolCall) for c in calls):
        raise TypeError(f"a tool-use turn must be a list of ToolCall, got {answer!r}")
    output = _message_tokens(Message.assistant("", calls))
    return ModelResponse(
        tool_calls=calls,
        usage=Usage(input_tokens=input_tokens, output_tokens=output),
        finish_reason="tool_calls",
        model=model_name,
    )


async def _stream_response(response: ModelResponse) -> AsyncIterator[ModelChunk]:
    words = _WORDS.findall(response.text)
    for start in range(0, len(words), _WORDS_PER_DELTA):
        yield TextDelta(text="".join(words[start : start + _WORDS_PER_DELTA]))
    for index, call in enumerate(response.tool_calls):
        yield ToolCallDelta(
            index=index, id=call.id, name=call.name, arguments_delta=json.dumps(call.arguments)
        )
    yield response


class ScriptedModel:
    """Plays back scripted turns, one per call to :meth:`stream`.

    Args:
        turns: The answers in call order. A ``str`` is a final text answer, a list of
            :class:`~loomflow.messages.ToolCall` is a tool-use turn, a ``ModelResponse`` is
            streamed as given, and an exception instance is raised by that call.
        name: The model id reported in responses (``"scripted"`` prices at 0).
        default: The answer once the script is used up: a string, or a function of the
            messages. Without one, an extra call raises
            :class:`~loomflow.errors.ScriptExhaustedError`.

    Attributes:
        calls: How many times ``stream`` was called.
        requests: The messages of every call, in order.
    """

    provider = "scripted"

    def __init__(
        self,
        turns: Sequence[ScriptTurn] = (),
        *,
        name: str = "scripted",
        default: str | Callable[[list[Message]], str] | None = None,
    ) -> None:
        self._name = name
        self._turns = list(turns)
        self._default = default
        self.calls = 0
        self.requests: list[list[Message]] = []

    @property
    def name(self) -> str:
        """The model id reported in responses."""
        return self._name

    @property
    def remaining(self) -> int:
        """Scripted turns not yet played."""
        return max(0, len(self._turns) - self.calls)

    def stream(
        self,
        messages: list[Message],
        *,
        tools: Sequence[ToolSpec] = (),
        settings: ModelSettings | None = None,
    ) -> AsyncIterator[ModelChunk]:
        """Stream the next scripted turn."""
        # The turn is taken now, not on first iteration, so call order fixes the script order.
        index = self.calls
        self.calls += 1
        self.requests.append(list(messages))
        turn: ScriptTurn | None = self._turns[index] if index < len(self._turns) else None
        return self._play(turn, index, list(messages))

    async def _play(
        self, turn: ScriptTurn | None, index: int, messages: list[Message]
    ) -> AsyncIterator[ModelChunk]:
        if turn is None:
            if self._default is None:
                raise ScriptExhaustedError(
                    self.provider,
                    self._name,
                    f"the script has {len(self._turns)} turn(s) and this is call "
                    f"{index + 1}; add turns, pass default=, or use FunctionModel",
                )
            turn = self._default if isinstance(self._default, str) else self._default(messages)
        if isinstance(turn, BaseException):
            raise turn
        async for chunk in _stream_response(_build_response(turn, messages, self._name)):
            yield chunk


class FunctionModel:
    """Answers each call with ``fn(messages, tools)``, sync or async.

    ``fn`` returns final text, a list of :class:`~loomflow.messages.ToolCall` for a tool-use
    turn, or a full ``ModelResponse``. Exceptions it raises propagate from the stream.

    Example:
        >>> def fn(messages, tools):
        ...     if messages[-1].role == "tool":
        ...         return f"the answer is {messages[-1].content}"
        ...     return [ToolCall(id="c1", name="add", arguments={"a": 1, "b": 2})]
        >>> model = FunctionModel(fn)

    Attributes:
        calls: How many times ``stream`` was called.
        requests: The messages of every call, in order.
    """

    provider = "scripted"

    def __init__(
        self,
        fn: Callable[[list[Message], list[ToolSpec]], FunctionResult | Awaitable[FunctionResult]],
        *,
        name: str = "function",
    ) -> None:
        self._fn = fn
        self._name = name
        self.calls = 0
        self.requests: list[list[Message]] = []

    @property
    def name(self) -> str:
        """The model id reported in responses."""
        return self._name

    def stream(
        self,
        messages: list[Message],
        *,
        tools: Sequence[ToolSpec] = (),
        settings: ModelSettings | None = None,
    ) -> AsyncIterator[ModelChunk]:
        """Stream the function's answer."""
        self.calls += 1
        self.requests.append(list(messages))
        return self._play(list(messages), list(tools))

    async def _play(
        self, messages: list[Message], tools: list[ToolSpec]
    ) -> AsyncIterator[ModelChunk]:
        result = self._fn(messages, tools)
        if inspect.isawaitable(result):
            result = await result
        async for chunk in _stream_response(_build_response(result, messages, self._name)):
            yield chunk
