"""OpenAI chat models through the official ``openai`` SDK (Chat Completions, streaming).

Needs the extra: ``pip install 'loomflow[openai]'``. The SDK is imported when an
:class:`OpenAIModel` is built, never when :mod:`loomflow.models` is imported. Servers that speak
the Chat Completions protocol (``OPENAI_BASE_URL`` pointing elsewhere) work the same way.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    retry_after_from,
    stream_error_status,
)
from ._sdk import SdkModel

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = ["OpenAIModel"]

# OpenAI finish reasons onto the neutral vocabulary; "function_call" is the legacy name.
_FINISH_REASONS = {"function_call": "tool_calls"}


def _import_sdk() -> Any:
    try:
        import openai
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "OpenAIModel needs the openai SDK: pip install 'loomflow[openai]'"
        ) from exc
    return openai


@dataclass
class _PendingCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class OpenAIModel(SdkModel["AsyncOpenAI"]):
    """An OpenAI chat model over Chat Completions with streaming.

    The client is built the SDK's standard way, so ``OPENAI_API_KEY`` and ``OPENAI_BASE_URL``
    work unchanged; ``base_url=``/``api_key=`` override them, or pass a ready
    ``openai.AsyncOpenAI`` as ``client`` (it stays yours to close). The SDK's own retries are
    disabled; this adapter retries transient failures (429, 5xx, dropped connections) with
    backoff, only before the first chunk has been yielded.

    Args:
        model: The model id, e.g. ``"gpt-4.1"``.
        client: A ready async client to use instead of building one.
        base_url: API base URL including ``/v1`` (default: ``OPENAI_BASE_URL`` or OpenAI's).
        api_key: API key (default: ``OPENAI_API_KEY``).
        max_retries: Retries after the first attempt.
        backoff: Waits between attempts.
        timeout: Seconds the SDK waits on the network each time (to connect, and for each
            read of a response or stream), per attempt; not a deadline for the whole
            call: bound that with ``asyncio.timeout`` around the run (default: the SDK's).
    """

    provider = "openai"
    _label = "OpenAI"
    _usage_hint = " (does the server ignore stream_options.include_usage?)"
    _credentials = (("api_key", "api_key= or OPENAI_API_KEY"),)

    @staticmethod
    def _import_sdk() -> Any:
        return _import_sdk()

    def _new_client(self, sdk: Any, options: dict[str, Any]) -> AsyncOpenAI:
        return sdk.AsyncOpenAI(**options)  # type: ignore[no-any-return]

    def _sdk_errors(self, sdk: Any) -> tuple[type[BaseException], ...]:
        return (sdk.OpenAIError,)

    def _request(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        settings: ModelSettings,
        output: OutputFormat | None,
    ) -> dict[str, Any]:
        request: dict[str, Any] = {
            "model": self._name,
            "messages": [_to_openai_message(m) for m in messages],
            "stream": True,
            # Without this the stream carries no token counts at all.
            "stream_options": {"include_usage": True},
            # ``max_tokens`` is refused by the reasoning models; this one works for all.
            "max_completion_tokens": settings.max_tokens,
        }
        if tools:
            request["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.parameters,
                    },
                }
                for t in tools
            ]
        if settings.temperature is not None:
            request["temperature"] = settings.temperature
        if output is not None:
            # strict only when the schema has a strict form (see OutputFormat.strict): the
            # API refuses strict schemas with optional fields or open objects.
            schema = _strict_form(output.json_schema) if output.strict else output.json_schema
            request["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": output.name,
                    "description": output.description,
                    "schema": schema,
                    "strict": output.strict,
                },
            }
        return request

    async def _attempt(
        self, request: dict[str, Any], output: OutputFormat | None
    ) -> AsyncGenerator[ModelChunk, None]:
        text: list[str] = []
        refused = False
        calls: dict[int, _PendingCall] = {}
        usage = Usage()
        usage_reported = False
        finish: str | None = None
        model = self._name
        stream: Any = await self._client.chat.completions.create(**request)
        async with stream:
            chunk: Any
            # The SDK builds chunks without validating them: every field read below is
            # checked (see _fields), so a malformed stream is a ModelError saying what was
            # wrong rather than a TypeError from deep inside the loop.
            # A drop once the finish reason and the usage came (OpenAI's last chunk, before
            # "[DONE]") loses nothing: the answer is whole and its cost known.
            ended = SdkEvents(
                stream,
                ended=lambda: finish is not None and usage_reported,
                drops=self._connection_errors,
            )
            async for chunk in ended:
                chunk = f.obj(chunk, "a chunk")
                if f.field(chunk, "object") == "error" and f.field(chunk, "choices") is None:
                    # An error in place of a chunk, without the "error" key the SDK looks for
                    # (older vLLM): raised as the SDK raises one with it.
                    error = {k: f.field(chunk, k) for k in ("message", "type", "code")}
                    raise self._sdk.APIError(
                        message=str(error["message"] or "an error object in the stream"),
                        request=stream.response.request,
                        body=error,
                    )
                model = f.optional_text(f.field(chunk, "model"), "model") or model
                reported = f.optional_obj(f.field(chunk, "usage"), "usage")
                if reported is not None:
                    usage, usage_reported = self._usage(reported)
                choices = f.field(chunk, "choices")
                if choices is None and reported is not None:
                    continue  # a usage-only chunk some servers send without "choices"
                for n, choice in enumerate(f.items(choices, "choices")):
                    choice = f.obj(choice, f"choices[{n}]")
                    # Only one candidate is ever requested; a server that leaves out its index
                    # sends that one (skipping it dropped the answer, and the call was retried).
                    if f.field(choice, "index") not in (0, None):
                        continue
                    delta = f.optional_obj(f.field(choice, "delta"), "choices[0].delta")
                    content = f.optional_text(f.field(delta, "content"), "choices[0].delta.content")
                    if content:
                        text.append(content)
                        yield TextDelta(text=content)
                    # A structured-output request the model declines: its reason is the text
                    # (validation then fails and says so).
                    refusal = f.optional_text(f.field(delta, "refusal"), "choices[0].delta.refusal")
                    if refusal:
                        refused = True
                        text.append(refusal)
                        yield TextDelta(text=refusal)
                    pieces = f.field(delta, "tool_calls")
                    where = "choices[0].delta.tool_calls"
                    for k, piece in enumerate(f.items(pieces, where) if pieces is not None else ()):
                        yield self._tool_call_delta(calls, piece, f"{where}[{k}]")
                    reason = f.optional_text(
                        f.field(choice, "finish_reason"), "choices[0].finish_reason"
                    )
                    if reason:
                        finish = reason
        if finish is None:
            raise ended_early(stream.response, "the stream ended without a finish_reason")
        if refused and finish == "stop":
            finish = "content_filter"  # declined, as Anthropic's "refusal" reads: not answered
        if not usage_reported:
            # A server that ignores stream_options.include_usage: the call's cost is unknown
            # (a budget charges its whole reservation; see ModelResponse.usage_reported).
            self._warn_usage_unreported()
        yield ModelResponse(
            text="".join(text),
            tool_calls=[
                self._tool_call(pending, cut=finish == "length") for pending in calls.values()
            ],
            usage=usage,
            finish_reason=_FINISH_REASONS.get(finish, finish),
            model=model,
            usage_reported=usage_reported,
        )

    @staticmethod
    def _tool_call_delta(calls: dict[int, _PendingCall], piece: Any, where: str) -> ToolCallDelta:
        """One streamed piece of a tool call, added to its pending call."""
        piece = f.obj(piece, where)
        call_id = f.optional_text(f.field(piece, "id"), f"{where}.id")
        function = f.optional_obj(f.field(piece, "function"), f"{where}.function")
        name = f.optional_text(f.field(function, "name"), f"{where}.function.name")
        arguments = f.optional_text(f.field(function, "arguments"), f"{where}.function.arguments")
        given = f.field(piece, "index")
        if given is not None:
            index = f.index(given, f"{where}.index")
        else:
            # Gemini's compatible endpoint numbers no call: a piece with an id of its own
            # starts one, as does one naming a tool without the last call's id (a call's
            # later pieces name none; two calls of one tool may come with no id at all);
            # any other continues the call before it. Kept under keys below 0, apart from
            # the numbers a server gives.
            last = calls[min(calls)] if any(k < 0 for k in calls) else None
            if last is None:
                starts = True
            elif call_id:
                starts = call_id != last.id
            else:
                starts = bool(name)
            index = min((*calls, 0)) - 1 if starts else min(calls)
        pending = calls.setdefault(index, _PendingCall())
        # A delta's index is the call's place in the response, numbered from 0 in the order
        # the calls came: a server's own numbering may skip (index 1 alone), and a delta that
        # named no call of the response would escape the sealing of sensitive arguments.
        slot = list(calls).index(index)
        if call_id:
            pending.id = call_id
        # OpenAI sends the name once, in the call's first piece; some compatible servers
        # repeat it in every piece, which must not make "getget".
        if name == pending.name:
            name = None
        if name:
            pending.name += name
        pending.arguments.append(arguments or "")
        return ToolCallDelta(
            index=slot, id=call_id or None, name=name or None, arguments_delta=arguments or ""
        )

    def _usage(self, reported: Any) -> tuple[Usage, bool]:
        """OpenAI's usage figures, and whether both counts were there: prompt tokens include
        the cached ones (reads; OpenAI reports no cache writes), which are kept apart for
        pricing at the cached-input rate."""
        prompt_tokens = f.field(reported, "prompt_tokens")
        completion_tokens = f.field(reported, "completion_tokens")
        prompt = self._reported_count("prompt_tokens", prompt_tokens)
        details = f.optional_obj(
            f.field(reported, "prompt_tokens_details"), "usage.prompt_tokens_details"
        )
        cached = f.field(details, "cached_tokens")
        usage = Usage(
            input_tokens=prompt,
            output_tokens=self._reported_count("completion_tokens", completion_tokens),
            # More cached than prompt tokens cannot be: the prompt is billed, at most all cached.
            cache_read_tokens=min(self._reported_count("cached_tokens", cached), prompt),
        )
        return usage, prompt_tokens is not None and completion_tokens is not None

    def _tool_call(self, pending: _PendingCall, *, cut: bool) -> ToolCall:
        name = tool_call_name(
            pending.name, provider=self.provider, model=self._name, call_id=pending.id
        )
        arguments = parse_tool_arguments(
            "".join(pending.arguments),
            provider=self.provider,
            model=self._name,
            tool=pending.name,
            call_id=pending.id,
            cut=cut,
        )
        return ToolCall(id=pending.id, name=name, arguments=arguments)

    def _classify(self, exc: Exception) -> Failure | None:
        """Map an SDK or transport exception to a :class:`Failure` (the one translation point)."""
        sdk = self._sdk
        if isinstance(exc, sdk.APIStatusError):
            status = exc.status_code
            return Failure(
                _detail(exc),
                status,
                # A 429 for an account out of credit is no rate limit: no retry can help.
                retryable=is_retryable_status(status) and not _out_of_quota(exc),
                retry_after=retry_after_from(exc.response.headers),
            )
        if isinstance(exc, (IncompleteStreamError, *self._connection_errors)):
            return Failure(connection_detail(exc), None, retryable=True)
        if isinstance(exc, MalformedStreamError):
            return Failure(f"malformed response stream: {exc}", None, retryable=False)
        if isinstance(exc, sdk.APIError):
            # An error object inside a 200 stream: no status, only its type or code, which
            # may stand for one (a rate limit, an overload), and is retried as that status.
            mapped = stream_error_status(exc.body)
            return Failure(
                _detail(exc),
                mapped,
                retryable=mapped is not None
                and is_retryable_status(mapped)
                and not _out_of_quota(exc),
            )
        if isinstance(exc, sdk.OpenAIError):
            return Failure(f"{type(exc).__name__}: {exc}", None, retryable=False)
        return None


def _strict_form(node: Any) -> Any:
    """``node`` in the words strict mode takes: each ``oneOf`` spelled ``anyOf``, and the
    keywords beside a ``$ref`` moved onto an ``anyOf`` of that one ``$ref``.

    Pydantic writes a discriminated union as ``oneOf`` (plus a ``discriminator`` that only
    points into it); its members differ in the tag's ``const``, so at most one can match and
    ``anyOf`` asks for the same answers. A described field of a model or enum type is a
    ``$ref`` with a ``description`` beside it. Done here, at send time, so that the format,
    and with it the journal key of every model call, stays as it was.
    """
    if isinstance(node, list):
        return [_strict_form(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _strict_form(value) for key, value in node.items()}
    if isinstance(out.get("oneOf"), list) and "anyOf" not in out:
        out["anyOf"] = out.pop("oneOf")
        out.pop("discriminator", None)
    if isinstance(out.get("$ref"), str) and len(out) > 1 and "anyOf" not in out:
        out["anyOf"] = [{"$ref": out.pop("$ref")}]
    return out


def _out_of_quota(exc: Any) -> bool:
    """Whether the error's ``type`` or ``code`` (in its body or the ``error`` object in it)
    says the account is out of credit (a 429 that no retry can help)."""
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error", body)
    error = error if isinstance(error, dict) else body
    return "insufficient_quota" in (error.get("type"), error.get("code"))


def _detail(exc: Any) -> str:
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return f"{error.get('type') or error.get('code') or 'error'}: {error['message']}"
    if isinstance(body, str) and body and body not in str(exc):
        # {"error": "..."} in a stream: the SDK's message is only "An error occurred during
        # streaming", the text is the body.
        return f"{exc}: {body[:300]!r}"
    return str(exc)


def _to_openai_message(message: Message) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    if message.role == "assistant" and message.tool_calls:
        return {
            "role": "assistant",
            # Null rather than "" when the turn is only tool calls, as the API itself returns.
            "content": message.content or None,
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for c in message.tool_calls
            ],
        }
    return {"role": message.role, "content": message.content}
