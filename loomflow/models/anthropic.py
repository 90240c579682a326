"""Claude models through the official ``anthropic`` SDK (Messages API, streaming).

Needs the extra: ``pip install 'loomflow[anthropic]'``. The SDK is imported when an
:class:`AnthropicModel` is built, never when :mod:`loomflow.models` is imported.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ..messages import (
    Message,
    ModelChunk,
    ModelResponse,
    ModelSettings,
    OutputFormat,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    Usage,
)
from . import _fields as f
from ._arguments import parse_tool_arguments, tool_call_name
from ._retry import (
    Failure,
    IncompleteStreamError,
    MalformedStreamError,
    SdkEvents,
    connection_detail,
    ended_early,
    is_retryable_status,
    not_json,
    read_sdk,
    retry_after_from,
    stream_error_status,
)
from ._sdk import SdkModel

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic

__all__ = ["AnthropicModel"]

# Anthropic stop reasons onto the neutral vocabulary of ModelResponse.finish_reason.
_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def _import_sdk() -> Any:
    try:
        import anthropic
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "AnthropicModel needs the anthropic SDK: pip install 'loomflow[anthropic]'"
        ) from exc
    return anthropic


class AnthropicModel(SdkModel["AsyncAnthropic"]):
    """A Claude model over the Messages API.

    The client is built the SDK's standard way, so ``ANTHROPIC_API_KEY`` and
    ``ANTHROPIC_BASE_URL`` work unchanged; ``base_url=``/``api_key=`` override them, or pass a
    ready ``anthropic.AsyncAnthropic`` as ``client`` (it stays yours to close). The SDK's own
    retries are disabled; this adapter retries transient failures (429, 5xx, 529, dropped
    connections) with backoff, only before the first chunk has been yielded.

    Args:
        model: The model id, e.g. ``"claude-opus-4-7"``.
        client: A ready async client to use instead of building one.
        base_url: API base URL (default: ``ANTHROPIC_BASE_URL`` or the public endpoint).
        api_key: API key (default: ``ANTHROPIC_API_KEY``).
        max_retries: Retries after the first attempt.
        backoff: Waits between attempts.
        timeout: Seconds the SDK waits on the network each time (to connect, and for each
            read of a response or stream), per attempt; not a deadline for the whole
            call: bound that with ``asyncio.timeout`` around the run (default: the SDK's).

    Example:
        >>> model = AnthropicModel("claude-opus-4-7")  # doctest: +SKIP
        >>> response = await complete(model, [Message.user("hello")])  # doctest: +SKIP
    """

    provider = "anthropic"
    _label = "Anthropic"
    _credentials = (
        ("api_key", "api_key= or ANTHROPIC_API_KEY"),
        ("auth_token", "ANTHROPIC_AUTH_TOKEN"),
    )

    @staticmethod
    def _import_sdk() -> Any:
        return _import_sdk()

    def _new_client(self, sdk: Any, options: dict[str, Any]) -> AsyncAnthropic:
        client = sdk.AsyncAnthropic(**options)
        # Recent SDKs accept a client without credentials and fail only when a request is
        # built, with a bare TypeError; say it now, as the OpenAI SDK does.
        # An empty key (ANTHROPIC_API_KEY="") is none: every request failed as a lost connection.
        if (
            not client.api_key
            and not client.auth_token
            and getattr(client, "credentials", None) is None
        ):
            raise ConfigurationError(
                "no credentials: set ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN), or pass api_key="
            )
        return client  # type: ignore[no-any-return]

    def _sdk_errors(self, sdk: Any) -> tuple[type[BaseException], ...]:
        return (sdk.AnthropicError,)

    def _request(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        settings: ModelSettings,
        output: OutputFormat | None,
    ) -> dict[str, Any]:
        system, turns = _to_anthropic_messages(messages)
        request: dict[str, Any] = {
            "model": self._name,
            "max_tokens": settings.max_tokens,
            "messages": turns,
        }
        if system:
            request["system"] = system
        if tools:
            request["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters}
                for t in tools
            ]
        if output is not None:
            # The answer is the input of a tool the model must call. Forcing that one tool
            # would keep the model from using the others, so with tools it must call one of
            # them ("any"), the answer tool among them.
            answer_tool = {
                "name": output.name,
                "description": output.description,
                "input_schema": output.json_schema,
            }
            request["tools"] = [*request.get("tools", []), answer_tool]
            request["tool_choice"] = (
                {"type": "any"} if tools else {"type": "tool", "name": output.name}
            )
        if settings.temperature is not None:
            # Sent as a body field: recent SDKs no longer list sampling parameters.
            request["extra_body"] = {"temperature": settings.temperature}
        return request

    async def _attempt(
        self, request: dict[str, Any], output: OutputFormat | None
    ) -> AsyncGenerator[ModelChunk, None]:
        # Content block index -> position among this response's tool calls.
        tool_slots: dict[int, int] = {}
        # Blocks calling the answer tool of structured output: their input streams as text.
        answer_blocks: set[int] = set()
        answer: list[str] = []
        # Arguments text per tool call: decoded here rather than trusting the SDK's
        # partial-JSON snapshot, which turns a truncated object into a smaller valid one.
        arguments: dict[int, list[str]] = {}
        started: set[int] = set()  # content blocks begun
        stopped = False
        start_usage: Any = None  # the usage of message_start, before message_delta's
        # Events are read by their ``type`` tags rather than SDK classes, whose names move
        # between SDK releases while the wire format stays put.
        manager: Any = self._client.messages.stream(**request)
        async with manager as stream:
            event: Any
            # The SDK builds events without validating them: the fields read here are
            # checked (see _fields), and the SDK's own errors on malformed data become
            # MalformedStreamError (SdkEvents, read_sdk).
            # A drop after message_stop loses nothing: the answer is whole.
            ended = SdkEvents(stream, ended=lambda: stopped, drops=self._connection_errors)
            async for event in ended:
                kind = f.field(event, "type")
                if kind == "content_block_start":
                    position = f.index(f.field(event, "index"), f"{kind}.index")
                    if position in started:
                        # A second start for one block: its tool call would run twice, the
                        # second time with arguments the model never sent.
                        raise MalformedStreamError(f"content block {position} started twice")
                    started.add(position)
                    block = f.obj(f.field(event, "content_block"), f"{kind}.content_block")
                    if f.field(block, "type") != "tool_use":
                        continue
                    where = f"{kind}.content_block"
                    name = f.text(f.field(block, "name"), f"{where}.name")
                    if output is not None and name == output.name:
                        answer_blocks.add(position)
                    else:
                        call_id = f.text(f.field(block, "id"), f"{where}.id")
                        slot = tool_slots.setdefault(position, len(tool_slots))
                        arguments[slot] = []
                        yield ToolCallDelta(index=slot, id=call_id, name=name)
                elif kind == "content_block_delta":
                    position = f.index(f.field(event, "index"), f"{kind}.index")
                    delta = f.obj(f.field(event, "delta"), f"{kind}.delta")
                    delta_type = f.field(delta, "type")
                    if delta_type == "text_delta":
                        piece = f.text(f.field(delta, "text"), f"{kind}.delta.text")
                        if piece:
                            yield TextDelta(text=piece)
                    elif delta_type == "input_json_delta":
                        piece = f.text(f.field(delta, "partial_json"), f"{kind}.delta.partial_json")
                        if position in answer_blocks:
                            if piece:
                                answer.append(piece)
                                yield TextDelta(text=piece)
                        elif position not in tool_slots:
                            raise MalformedStreamError(
                                f"an input_json_delta came for content block {position}, "
                                "which is not a tool_use block"
                            )
                        elif piece:
                            slot = tool_slots[position]
                            arguments[slot].append(piece)
                            yield ToolCallDelta(index=slot, arguments_delta=piece)
                elif kind == "message_start":
                    begun = f.optional_obj(f.field(event, "message"), f"{kind}.message")
                    start_usage = f.optional_obj(f.field(begun, "usage"), f"{kind}.usage")
                elif kind == "message_stop":
                    stopped = True
            if not stopped:
                raise ended_early(stream.response, "the event stream ended before message_stop")
            message = await read_sdk(stream.get_final_message())
        yield self._response(
            message,
            ["".join(arguments[i]) for i in sorted(arguments)],
            output,
            "".join(answer),
            start_usage,
        )

    def _response(
        self,
        message: Any,
        arguments: list[str],
        output: OutputFormat | None = None,
        answer: str = "",
        start_usage: Any = None,
    ) -> ModelResponse:
        message = f.obj(message, "the message")
        text: list[str] = []
        calls: list[ToolCall] = []
        answered: str | None = None
        stop = f.optional_text(f.field(message, "stop_reason"), "stop_reason")
        for n, block in enumerate(f.items(f.field(message, "content"), "content")):
            block = f.obj(block, f"content[{n}]")
            kind = f.field(block, "type")
            if kind == "text":
                text.append(f.text(f.field(block, "text"), f"content[{n}].text"))
            elif kind != "tool_use":
                continue
            elif output is not None and f.field(block, "name") == output.name:
                # No deltas: the start event held the whole input.
                answered = answer or json.dumps(f.field(block, "input"))
            else:
                name = f.text(f.field(block, "name"), f"content[{n}].name")
                call_id = f.text(f.field(block, "id"), f"content[{n}].id")
                name = tool_call_name(
                    name, provider=self.provider, model=self._name, call_id=call_id
                )
                raw = arguments[len(calls)] if len(calls) < len(arguments) else ""
                given = f.field(block, "input")
                if not raw and isinstance(given, dict):
                    decoded = dict(given)  # no deltas: the start event held the input
                else:
                    # Streamed text, or an input that is not an object (decoded to say so:
                    # running the tool with {} would run it with arguments never sent).
                    decoded = parse_tool_arguments(
                        raw or json.dumps(given),
                        provider=self.provider,
                        model=self._name,
                        tool=name,
                        call_id=call_id,
                        cut=_FINISH_REASONS.get(stop or "") == "length",
                    )
                calls.append(ToolCall(id=call_id, name=name, arguments=decoded))
        usage = f.optional_obj(f.field(message, "usage"), "usage")
        # Anthropic reports uncached input apart from cache writes and reads; all three are
        # input (as the GenAI conventions count it), and the cache parts are kept apart for
        # pricing at their own rates.
        count = self._reported_count

        def cumulative(name: str) -> int:
            # message_delta's figures are cumulative: one below message_start's (some
            # compatible servers send 0 there) cannot undo what the start reported.
            start = count(name, f.field(start_usage, name)) if start_usage is not None else 0
            return max(count(name, f.field(usage, name)), start)

        writes = cumulative("cache_creation_input_tokens")
        reads = cumulative("cache_read_input_tokens")
        input_tokens = f.field(usage, "input_tokens")
        output_tokens = f.field(usage, "output_tokens")
        # Each part may be plausible and their sum not: checked as the one figure it becomes.
        total_input = count(
            "input_tokens + cache_creation_input_tokens + cache_read_input_tokens",
            cumulative("input_tokens") + writes + reads,
        )
        reported = input_tokens is not None and output_tokens is not None
        if not reported:
            self._warn_usage_unreported()
        if answered is not None and not calls:
            # The answer tool's input is the answer; the tool itself never runs. Called beside
            # other tools, it is dropped: their results come first, and the model answers again.
            text = [answered]
            if stop == "tool_use":
                stop = "end_turn"  # a cut-off answer keeps "max_tokens": it reads as "length"
        return ModelResponse(
            text="".join(text),
            tool_calls=calls,
            usage=Usage(
                input_tokens=total_input,
                output_tokens=count("output_tokens", output_tokens),
                cache_read_tokens=reads,
                cache_write_tokens=writes,
            ),
            finish_reason=_FINISH_REASONS.get(stop, stop) if stop else "stop",
            model=f.optional_text(f.field(message, "model"), "model") or self._name,
            usage_reported=reported,
        )

    def _classify(self, exc: Exception) -> Failure | None:
        """Map an SDK or transport exception to a :class:`Failure` (the one translation point)."""
        sdk = self._sdk
        if isinstance(exc, sdk.APIStatusError):
            status = exc.status_code
            if status < 400:
                # An ``event: error`` inside a 200 stream: its error type tells what happened.
                if isinstance(exc.body, str):  # the SDK could not read it as JSON
                    return Failure(
                        f"the stream sent an error event that is {not_json(exc.body)}",
                        None,
                        retryable=False,
                    )
                mapped = stream_error_status(exc.body)
                return Failure(
                    _detail(exc),
                    mapped,
                    retryable=mapped is not None and is_retryable_status(mapped),
                )
            return Failure(
                _detail(exc),
                status,
                retryable=is_retryable_status(status),
                retry_after=retry_after_from(exc.response.headers),
            )
        if isinstance(exc, (IncompleteStreamError, *self._connection_errors)):
            return Failure(connection_detail(exc), None, retryable=True)
        if isinstance(exc, MalformedStreamError):
            return Failure(f"malformed response stream: {exc}", None, retryable=False)
        if isinstance(exc, sdk.AnthropicError):
            return Failure(f"{type(exc).__name__}: {exc}", None, retryable=False)
        return None


def _detail(exc: Any) -> str:
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return f"{error.get('type') or error.get('code') or 'error'}: {error['message']}"
    return str(exc)


def _to_anthropic_messages(messages: list[Message]) -> tuple[str, list[dict[str, Any]]]:
    """Split out the system prompt and turn the rest into Messages API turns.

    The API takes one system prompt, so every system message joins it, in order. Tool results
    become ``tool_result`` blocks of a user turn, and consecutive turns of one role merge into a
    single turn, because the API expects the roles to alternate.
    """
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for message in messages:
        role = "assistant" if message.role == "assistant" else "user"
        blocks: list[dict[str, Any]] = []
        if message.role == "system":
            system.append(message.content)
            continue
        if message.role == "tool":
            result: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": message.tool_call_id,
                "content": message.content,
            }
            if message.is_error:
                result["is_error"] = True
            blocks.append(result)
        else:
            # The API refuses empty text blocks, and blank ones in a turn with no other text
            # (Claude may write only "\n\n" before its tool calls): they carry nothing.
            if message.content.strip():
                blocks.append({"type": "text", "text": message.content})
            blocks.extend(
                {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
                for c in message.tool_calls
            )
        if not blocks:
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return "\n\n".join(s for s in system if s), turns
