"""Deterministic models for tests, demos and examples: no network, no randomness.

:class:`ScriptedModel` plays back a fixed list of turns, choosing each from the conversation it
is sent; :class:`FunctionModel` answers with a function of the conversation. Both stream like a
real model (text in a few deltas, one delta per tool call, then the
:class:`~loomflow.messages.ModelResponse`), count tokens with a fixed rule, and count their
calls, so a test can assert that a resumed run made no model call at all::

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

from .._memo import PerInstance
from ..errors import InvalidArgumentTypeError, ScriptExhaustedError
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
    "script_position",
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


_tokens: PerInstance[int] = PerInstance()  # messages are frozen: counted once each


def _message_tokens(message: Message) -> int:
    count = _tokens.get(message, 0)
    if count is None:
        count = _count_tokens(message)
        _tokens.put(message, 0, count)
    return count


def _count_tokens(message: Message) -> int:
    return approx_tokens(message.content) + _call_tokens(message.tool_calls)


def _call_tokens(calls: Sequence[ToolCall]) -> int:
    if not calls:
        return 0
    return approx_tokens("".join(c.name + json.dumps(c.arguments, sort_keys=True) for c in calls))


def echo_last_user(messages: Sequence[Message]) -> str:
    """The default answer of ``resolve_model("scripted")``: echoes the last user message."""
    for message in reversed(messages):
        if message.role == "user":
            return f"Echo: {message.content}"
    return "Echo: (no user message)"


def _check_answer(answer: object, what: str) -> None:
    """Refuse an answer that is no final text, no list of ``ToolCall`` and no response."""
    if isinstance(answer, str | ModelResponse):
        return
    if isinstance(answer, Sequence) and all(isinstance(c, ToolCall) for c in answer):
        return
    raise InvalidArgumentTypeError(
        f"{what} must be a final answer (a str), a tool-use turn (a list of ToolCall) or a "
        f"ModelResponse, not {answer!r}"
    )


def _check_function(fn: object) -> None:
    """A ``FunctionModel``'s function is called as ``fn(messages, tools)``."""
    if not callable(fn):
        raise InvalidArgumentTypeError(
            f"FunctionModel takes a function of (messages, tools), not {fn!r}"
        )
    try:
        inspect.signature(fn).bind(..., ...)
    except TypeError:
        raise InvalidArgumentTypeError(
            f"FunctionModel calls its function as fn(messages, tools): {fn!r} cannot take "
            "those two arguments"
        ) from None
    except ValueError:  # no signature to read (some builtins): the call will tell
        return


def _build_response(
    answer: FunctionResult, messages: Sequence[Message], model_name: str
) -> ModelResponse:
    if isinstance(answer, ModelResponse):
        return answer
    input_tokens = sum(map(_message_tokens, messages))
    if isinstance(answer, str):
        return ModelResponse(
            text=answer,
            usage=Usage(input_tokens=input_tokens, output_tokens=approx_tokens(answer)),
            finish_reason="stop",
            model=model_name,
        )
    _check_answer(answer, "the answer of a FunctionModel's function")
    calls = list(answer)
    output = _call_tokens(calls)  # what the assistant message of these calls counts
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


def script_position(messages: Sequence[Message]) -> int:
    """The script turn a :class:`ScriptedModel` answers ``messages`` with.

    It is the number of assistant messages already in them: each answer the model gave and
    that is still in the conversation moves the script on by one.
    """
    return sum(1 for message in messages if message.role == "assistant")


class ScriptedModel:
    """Plays back scripted turns, choosing each one from the conversation it is sent.

    The turn answered is :func:`script_position` of the request: the number of assistant
    messages already in it. The first request of a conversation gets turn 0; after one
    tool-use turn and its results, turn 1; and so on. Like a real deterministic model, the
    answer depends only on the conversation, never on how often this object was called, so a
    run resumed in a new process (whose finished model calls replay from the journal) gets
    the turn that comes next rather than the script's start again.

    What counts is what the model is shown: with memory, a later run of the same session is
    sent the earlier runs' turns too, so it continues the script where they stopped; a new
    session, or an agent with ``memory=False``, starts at turn 0. Only the
    ``history_episodes`` latest episodes are sent back, so keep scripted sessions shorter
    than that. Give independent conversations a model each.

    Args:
        turns: The answers in conversation order. A ``str`` is a final text answer, a list of
            :class:`~loomflow.messages.ToolCall` is a tool-use turn, and a ``ModelResponse``
            is streamed as given. An exception instance takes no turn of its own: it is
            raised once, by the first call that reaches the answer after it (then that call
            repeated gets the answer), to test a failing provider.
        name: The model id reported in responses (``"scripted"`` prices at 0).
        default: The answer for turns past the script: a string, or a function of the
            messages. Without one, such a call raises
            :class:`~loomflow.errors.ScriptExhaustedError`.

    Example:
        >>> model = ScriptedModel(
        ...     [
        ...         [ToolCall(id="c1", name="add", arguments={"a": 1, "b": 2})],  # turn 0
        ...         "1 + 2 = 3",  # turn 1, asked once the tool result is in
        ...     ]
        ... )

    Attributes:
        calls: How many times ``stream`` was called on this object.
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
        self._default = default
        self._answers: list[FunctionResult] = []
        # _failures[p]: the exceptions still to raise before answer p (one list per position).
        self._failures: list[list[BaseException]] = [[]]
        if isinstance(turns, str):
            raise InvalidArgumentTypeError(
                f"turns must be a list of turns, not one string: write ScriptedModel([{turns!r}])"
            )
        for index, turn in enumerate(turns):
            if isinstance(turn, BaseException):
                self._failures[-1].append(turn)
            else:
                _check_answer(turn, f"scripted turn {index}")
                self._answers.append(turn)
                self._failures.append([])
        self._reached = 0  # one past the furthest turn answered
        self.calls = 0
        self.requests: list[list[Message]] = []

    @property
    def name(self) -> str:
        """The model id reported in responses."""
        return self._name

    @property
    def remaining(self) -> int:
        """Scripted turns past the furthest one answered, plus exceptions not yet raised."""
        pending = sum(len(f) for f in self._failures[self._reached :])
        return max(0, len(self._answers) - self._reached) + pending

    def stream(
        self,
        messages: list[Message],
        *,
        tools: Sequence[ToolSpec] = (),
        settings: ModelSettings | None = None,
    ) -> AsyncIterator[ModelChunk]:
        """Stream the turn that answers ``messages``."""
        # The turn (and any exception due before it) is taken now, not on first iteration.
        position = script_position(messages)
        self.calls += 1
        self.requests.append(list(messages))
        failures = self._failures[min(position, len(self._answers))]
        failure = failures.pop(0) if failures else None
        turn: FunctionResult | None = None
        if failure is None and position < len(self._answers):
            turn = self._answers[position]
            self._reached = max(self._reached, position + 1)
        return self._play(turn, failure, position, list(messages))

    async def _play(
        self,
        turn: FunctionResult | None,
        failure: BaseException | None,
        position: int,
        messages: list[Message],
    ) -> AsyncIterator[ModelChunk]:
        if failure is not None:
            raise failure
        if turn is None:
            if self._default is None:
                raise ScriptExhaustedError(
                    self.provider,
                    self._name,
                    # Turns are numbered from 0, as in the docs. The usual cause is memory:
                    # a later run on the session is sent the earlier runs' turns as well.
                    f"the script has {len(self._answers)} turn(s), numbered from 0, and the "
                    f"conversation asks for turn {position} (it already holds {position} "
                    "assistant message(s), earlier runs on this session included when memory "
                    "is on); add turns, pass default=, use a new session or memory=False, "
                    "or use FunctionModel",
                )
            turn = self._default if isinstance(self._default, str) else self._default(messages)
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
        _check_function(fn)
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
