"""Local fake servers that speak the Anthropic and OpenAI wire formats.

Point a real SDK client (or a loomflow adapter) at one of these to test model code end to end
without a network or an API key: requests travel over real HTTP on 127.0.0.1, and the replies
are real JSON bodies and server-sent event streams in each provider's format.

Each server plays back a queue of scripted :class:`Reply` and :class:`Failure` items, one per
request, and records every request it receives::

    with FakeAnthropicAPI(Failure(529), Reply(text="Hello there")) as api:
        model = AnthropicModel("claude-opus-4-7", base_url=api.base_url, api_key="test")
        response = await complete(model, [Message.user("hi")])
        assert api.request_count == 2  # one overloaded answer, one retry
        await model.aclose()

The servers run in a background thread, so they work with sync and async clients alike.

Structured-output requests are honoured as the providers do: a request that forces a tool
(Anthropic ``tool_choice``) gets that tool called, its input being :attr:`Reply.structured`
(or the reply's text, taken as raw JSON); a request with an OpenAI ``response_format`` of type
``json_schema`` gets :attr:`Reply.structured` (or the text) as its message content, and a
``strict`` schema that strict mode would refuse gets the HTTP 400 the real API gives. Both
refuse, as the real APIs do, a tool input schema or response format schema that is not an
object at its top level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import re
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, ClassVar, Self

from ..messages import ToolCall

__all__ = [
    "Failure",
    "FakeAnthropicAPI",
    "FakeOpenAIAPI",
    "FakeProviderAPI",
    "RecordedRequest",
    "Reply",
]

_WORDS = re.compile(r"\S+\s*|\s+")


@dataclass(frozen=True)
class Reply:
    """A successful model answer, rendered in the provider's format.

    Attributes:
        text: The answer text. A string streams in word-sized deltas; a sequence of strings
            streams as exactly those deltas.
        tool_calls: Tool calls to return (their arguments stream in two pieces).
        input_tokens: Reported prompt tokens, as the provider counts them: Anthropic's
            ``input_tokens`` (without the cache), OpenAI's ``prompt_tokens`` (with it).
        output_tokens: Reported completion tokens.
        cache_read_tokens: Prompt tokens served from the cache (Anthropic's
            ``cache_read_input_tokens``, OpenAI's ``prompt_tokens_details.cached_tokens``).
        cache_write_tokens: Prompt tokens written to the cache (Anthropic's
            ``cache_creation_input_tokens``; OpenAI reports none).
        stop_reason: The provider's own stop/finish reason; by default ``end_turn``/``stop``,
            or ``tool_use``/``tool_calls`` when there are tool calls.
        model: Reported model id; by default the one the request named.
        cut_after: For streamed replies, drop the connection after this many events.
        end_after: For streamed replies, end the body cleanly after this many events: complete
            as HTTP, but missing the provider's end-of-message events.
        raw_arguments: Streamed replies only: the JSON text to send as each tool call's
            arguments instead of the encoded ``arguments`` (to test malformed model output).
        structured: The answer to a structured-output request (a forced Anthropic tool, an
            OpenAI ``json_schema`` response format), sent as JSON; when ``None`` such a
            request gets the reply's text as the raw JSON answer (to test malformed output).
        refusal: OpenAI only: the model declines, with this reason in the message's
            ``refusal`` field instead of content (as structured-output requests can).
        report_usage: ``False`` leaves the token counts out, as some servers do: OpenAI
            sends no usage chunk even when ``stream_options.include_usage`` asks for one;
            Anthropic sends empty ``usage`` objects.
        raw_stream: Streamed replies only: the body to send, piece by piece, instead of the
            events the other fields describe (to test malformed streams: a field of the wrong
            type, events out of order, bytes that are not UTF-8). A ``str`` piece is sent as
            UTF-8; ``cut_after`` and ``end_after`` count pieces.
        ignore_stream: Answer a streamed request with the whole JSON body, as a server that
            does not stream (one that ignores ``"stream": true``) does.
    """

    text: str | Sequence[str] = ""
    tool_calls: Sequence[ToolCall] = ()
    input_tokens: int = 12
    output_tokens: int = 7
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    stop_reason: str | None = None
    model: str | None = None
    cut_after: int | None = None
    end_after: int | None = None
    raw_arguments: Sequence[str] | None = None
    structured: Any = None
    refusal: str | None = None
    report_usage: bool = True
    raw_stream: Sequence[bytes | str] | None = None
    ignore_stream: bool = False

    @property
    def structured_json(self) -> str:
        """The JSON text of the answer to a structured-output request."""
        if self.structured is not None:
            return json.dumps(self.structured)
        return self.full_text

    def arguments_json(self, index: int) -> str:
        """The arguments text streamed for tool call ``index``."""
        if self.raw_arguments is not None:
            return self.raw_arguments[index]
        return json.dumps(self.tool_calls[index].arguments)

    def deltas(self) -> list[str]:
        """The text deltas a stream sends."""
        if not isinstance(self.text, str):
            return [t for t in self.text if t]
        words = _WORDS.findall(self.text)
        return ["".join(words[i : i + 2]) for i in range(0, len(words), 2)]

    @property
    def full_text(self) -> str:
        """The whole answer text."""
        return self.text if isinstance(self.text, str) else "".join(self.text)


@dataclass(frozen=True)
class Failure:
    """An error answer in the provider's error format.

    Attributes:
        status: HTTP status, e.g. 429, 500, 503, 529 or 400.
        message: Human-readable error message.
        error_type: The provider's error type; by default derived from ``status``.
        headers: Extra response headers, e.g. ``{"retry-after": "0"}``.
        in_stream: Send a 200 event stream whose first event is the error, as providers do
            when they fail after accepting a streaming request.
    """

    status: int = 500
    message: str = "fake provider failure"
    error_type: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    in_stream: bool = False


@dataclass(frozen=True)
class RecordedRequest:
    """One request the fake server received."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: Any

    @property
    def streamed(self) -> bool:
        """Whether the request asked for a stream."""
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


class _Dropped(Exception):
    """Raised inside the handler to cut a stream short."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_POST(self) -> None:
        self.server.fake._handle(self)

    def do_GET(self) -> None:
        self.server.fake._handle(self)

    def log_message(self, format: str, *args: Any) -> None:
        """Keep test output quiet."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeProviderAPI

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-stream is expected in retry tests; stay quiet about it.
        if isinstance(sys.exc_info()[1], ConnectionError | _Dropped):
            return
        super().handle_error(request, client_address)


class _Exchange:
    """Writes one HTTP response on a handler, with chunked bodies for streams."""

    def __init__(self, handler: _Handler) -> None:
        self.handler = handler

    def json(self, status: int, body: Any, headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        h = self.handler
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Connection", "close")
        for name, value in (headers or {}).items():
            h.send_header(name, value)
        h.end_headers()
        h.wfile.write(data)
        h.close_connection = True

    def start_stream(self) -> None:
        h = self.handler
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True

    def chunk(self, data: bytes) -> None:
        self.handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.handler.wfile.flush()

    def end_stream(self) -> None:
        self.handler.wfile.write(b"0\r\n\r\n")
        self.handler.wfile.flush()

    def drop(self) -> None:
        """Cut the connection mid-body, as a crashed proxy would."""
        self.handler.wfile.flush()
        with contextlib.suppress(OSError):
            self.handler.connection.shutdown(socket.SHUT_RDWR)
        raise _Dropped


class FakeProviderAPI:
    """Base of the fake provider servers: queueing, recording and the HTTP plumbing.

    Args:
        *replies: Answers to give, one per request, in order.
        default: The answer once the queue is empty; without one, an extra request gets an
            HTTP 400 that names the problem.
        event_delay: Seconds to pause between stream events (to test slow streams).
    """

    provider: ClassVar[str] = ""
    route: ClassVar[str] = ""
    _ids = itertools.count(1)

    def __init__(
        self,
        *replies: Reply | Failure,
        default: Reply | Failure | None = None,
        event_delay: float = 0.0,
    ) -> None:
        self._queue: deque[Reply | Failure] = deque(replies)
        self._default = default
        self._lock = threading.Lock()
        self._event_delay = event_delay
        self.requests: list[RecordedRequest] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Self:
        """Listen on a free port of 127.0.0.1 and serve in a background thread."""
        if self._server is not None:
            return self
        server = _Server(("127.0.0.1", 0), _Handler)
        server.fake = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fake-{self.provider}-api",
            daemon=True,
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def port(self) -> int:
        """The port the server listens on."""
        if self._server is None:
            raise RuntimeError("the fake server is not started")
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        """The base URL to give the provider's SDK."""
        raise NotImplementedError

    # -- scripting ---------------------------------------------------------------------------

    def add(self, *replies: Reply | Failure) -> None:
        """Queue more answers."""
        with self._lock:
            self._queue.extend(replies)

    @property
    def request_count(self) -> int:
        """How many requests reached the server."""
        with self._lock:
            return len(self.requests)

    @property
    def last_request(self) -> RecordedRequest:
        """The most recent request."""
        with self._lock:
            return self.requests[-1]

    def _next(self) -> Reply | Failure | None:
        with self._lock:
            if self._queue:
                return self._queue.popleft()
            return self._default

    # -- request handling --------------------------------------------------------------------

    def _handle(self, handler: _Handler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        path = handler.path.split("?", 1)[0]
        record = RecordedRequest(
            method=handler.command,
            path=path,
            headers={k.lower(): v for k, v in handler.headers.items()},
            body=body,
        )
        with self._lock:
            self.requests.append(record)
            number = len(self.requests)
        out = _Exchange(handler)
        if handler.command != "POST" or path != self.route:
            self._error(out, Failure(404, f"no route {handler.command} {path} on this fake"))
            return
        refused = self._refuse(record)
        if refused is not None:
            self._error(out, refused)
            return
        answer = self._next()
        if isinstance(answer, Reply):
            answer = self._shape(answer, record)
        if answer is None:
            answer = Failure(
                400,
                f"{type(self).__name__} has no scripted answer left for request #{number}",
            )
        try:
            if isinstance(answer, Failure):
                if answer.in_stream and record.streamed:
                    out.start_stream()
                    self._stream_error(out, answer)
                    out.end_stream()
                else:
                    self._error(out, answer)
            elif record.streamed and not answer.ignore_stream:
                self._stream(out, answer, record)
            else:
                out.json(200, self._message(answer, record))
        except (_Dropped, ConnectionError):
            handler.close_connection = True

    def _stream(self, out: _Exchange, reply: Reply, request: RecordedRequest) -> None:
        out.start_stream()
        events: Iterator[bytes] = (
            self._events(reply, request)
            if reply.raw_stream is None
            else (p.encode() if isinstance(p, str) else p for p in reply.raw_stream)
        )
        for sent, event in enumerate(events):
            if reply.cut_after is not None and sent >= reply.cut_after:
                out.drop()
            if reply.end_after is not None and sent >= reply.end_after:
                break
            if self._event_delay:
                time.sleep(self._event_delay)
            out.chunk(event)
        out.end_stream()

    def _model(self, reply: Reply, request: RecordedRequest) -> str:
        if reply.model is not None:
            return reply.model
        if isinstance(request.body, dict) and isinstance(request.body.get("model"), str):
            return str(request.body["model"])
        return "fake-model"

    @staticmethod
    def _split(text: str) -> list[str]:
        # Two pieces, so clients have to stitch partial JSON back together.
        middle = len(text) // 2
        return [p for p in (text[:middle], text[middle:]) if p]

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):06d}"

    # -- provider formats (subclasses) -------------------------------------------------------

    def _refuse(self, request: RecordedRequest) -> Failure | None:
        """The error the real API gives a request it refuses outright, if any."""
        return None

    def _shape(self, reply: Reply, request: RecordedRequest) -> Reply:
        """The reply as the request's options (a forced tool, a response format) make it."""
        return reply

    def _error(self, out: _Exchange, failure: Failure) -> None:
        raise NotImplementedError

    def _stream_error(self, out: _Exchange, failure: Failure) -> None:
        raise NotImplementedError

    def _message(self, reply: Reply, request: RecordedRequest) -> Any:
        raise NotImplementedError

    def _events(self, reply: Reply, request: RecordedRequest) -> Iterator[bytes]:
        raise NotImplementedError


_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def _sse(event: str | None, data: Any) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


class FakeAnthropicAPI(FakeProviderAPI):
    """A fake of the Anthropic Messages API (``POST /v1/messages``, JSON or SSE)."""

    provider = "anthropic"
    route = "/v1/messages"

    @property
    def base_url(self) -> str:
        """The URL for ``base_url=`` or ``ANTHROPIC_BASE_URL``."""
        return f"http://127.0.0.1:{self.port}"

    def _error_body(self, failure: Failure) -> dict[str, Any]:
        kind = failure.error_type or _ANTHROPIC_ERROR_TYPES.get(failure.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": failure.message}}

    def _error(self, out: _Exchange, failure: Failure) -> None:
        headers = {"request-id": self._new_id("req_fake_"), **failure.headers}
        out.json(failure.status, self._error_body(failure), headers)

    def _stream_error(self, out: _Exchange, failure: Failure) -> None:
        out.chunk(_sse("error", self._error_body(failure)))

    @staticmethod
    def _stop_reason(reply: Reply) -> str:
        if reply.stop_reason is not None:
            return reply.stop_reason
        return "tool_use" if reply.tool_calls else "end_turn"

    @staticmethod
    def _tool_names(request: RecordedRequest) -> list[str]:
        body = request.body if isinstance(request.body, dict) else {}
        tools = body.get("tools")
        if not isinstance(tools, list):
            return []
        return [str(t.get("name")) for t in tools if isinstance(t, dict)]

    def _refuse(self, request: RecordedRequest) -> Failure | None:
        body = request.body if isinstance(request.body, dict) else {}
        tools = body.get("tools")
        for index, tool in enumerate(tools if isinstance(tools, list) else ()):
            schema = tool.get("input_schema") if isinstance(tool, dict) else None
            if not isinstance(schema, dict) or schema.get("type") != "object":
                # As the real API: a tool's input is always an object (a top-level "$ref"
                # is refused, even one to an object definition).
                return Failure(
                    400, f"tools.{index}.custom.input_schema.type: Input should be 'object'"
                )
        blank = self._blank_text(body.get("messages"))
        if blank is not None:
            return blank
        choice = body.get("tool_choice")
        if choice is None:
            return None
        names = self._tool_names(request)
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool"):
            return Failure(400, f"tool_choice: unknown form {choice!r}")
        if choice["type"] == "tool" and choice.get("name") not in names:
            return Failure(400, f"tool_choice names tool {choice.get('name')!r}, not in tools")
        if choice["type"] in ("any", "tool") and not names:
            return Failure(400, "tool_choice requires tools")
        return None

    @staticmethod
    def _blank_text(messages: object) -> Failure | None:
        """As the real API: an empty text block is refused, and so is one of only whitespace
        in a message with no other text."""
        for message in messages if isinstance(messages, list) else ():
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            texts = [
                b.get("text") for b in content if isinstance(b, dict) and b.get("type") == "text"
            ]
            if "" in texts:
                return Failure(400, "messages: text content blocks must be non-empty")
            if texts and not any(isinstance(t, str) and t.strip() for t in texts):
                blank = "messages: text content blocks must contain non-whitespace text"
                return Failure(400, blank)
        return None

    def _shape(self, reply: Reply, request: RecordedRequest) -> Reply:
        body = request.body if isinstance(request.body, dict) else {}
        choice = body.get("tool_choice")
        if not isinstance(choice, dict) or choice.get("type") not in ("any", "tool"):
            return reply
        if choice["type"] == "any" and reply.tool_calls:
            return reply  # the model chose one of the tools itself
        # A forced tool (or "any" with nothing else to call: the last tool offered) is called
        # with the structured answer as its input.
        name = str(choice["name"]) if choice["type"] == "tool" else self._tool_names(request)[-1]
        raw = reply.structured_json
        try:
            decoded = json.loads(raw)
        except ValueError:
            decoded = None
        call = ToolCall(
            id=self._new_id("toolu_fake_"),
            name=name,
            arguments=decoded if isinstance(decoded, dict) else {},
        )
        return dataclasses.replace(reply, text="", tool_calls=[call], raw_arguments=[raw])

    def _message(self, reply: Reply, request: RecordedRequest) -> Any:
        content: list[dict[str, Any]] = []
        if reply.full_text:
            content.append({"type": "text", "text": reply.full_text})
        content.extend(
            {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
            for c in reply.tool_calls
        )
        return {
            "id": self._new_id("msg_fake_"),
            "type": "message",
            "role": "assistant",
            "model": self._model(reply, request),
            "content": content,
            "stop_reason": self._stop_reason(reply),
            "stop_sequence": None,
            "usage": self._usage(reply, reply.output_tokens),
        }

    @staticmethod
    def _usage(reply: Reply, output_tokens: int) -> dict[str, int]:
        if not reply.report_usage:
            return {}
        return {
            "input_tokens": reply.input_tokens,
            "cache_creation_input_tokens": reply.cache_write_tokens,
            "cache_read_input_tokens": reply.cache_read_tokens,
            "output_tokens": output_tokens,
        }

    def _events(self, reply: Reply, request: RecordedRequest) -> Iterator[bytes]:
        message = self._message(reply, request)
        message.update(content=[], stop_reason=None)
        message["usage"] = self._usage(reply, 1)
        yield _sse("message_start", {"type": "message_start", "message": message})
        yield _sse("ping", {"type": "ping"})
        index = 0
        deltas = reply.deltas()
        if deltas:
            start = {"type": "text", "text": ""}
            yield _sse(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": start},
            )
            for text in deltas:
                delta = {"type": "text_delta", "text": text}
                yield _sse(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                )
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
            index += 1
        for number, call in enumerate(reply.tool_calls):
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            yield _sse(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
            for piece in self._split(reply.arguments_json(number)):
                delta = {"type": "input_json_delta", "partial_json": piece}
                yield _sse(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                )
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
            index += 1
        yield _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": self._stop_reason(reply), "stop_sequence": None},
                "usage": {"output_tokens": reply.output_tokens} if reply.report_usage else {},
            },
        )
        yield _sse("message_stop", {"type": "message_stop"})


_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_exceeded",
}


class FakeOpenAIAPI(FakeProviderAPI):
    """A fake of OpenAI Chat Completions (``POST /v1/chat/completions``, JSON or SSE)."""

    provider = "openai"
    route = "/v1/chat/completions"

    @property
    def base_url(self) -> str:
        """The URL for ``base_url=`` or ``OPENAI_BASE_URL`` (it includes ``/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def _error_body(self, failure: Failure) -> dict[str, Any]:
        kind = failure.error_type or _OPENAI_ERROR_TYPES.get(failure.status, "server_error")
        return {"error": {"message": failure.message, "type": kind, "param": None, "code": None}}

    def _error(self, out: _Exchange, failure: Failure) -> None:
        headers = {"x-request-id": self._new_id("req_fake_"), **failure.headers}
        out.json(failure.status, self._error_body(failure), headers)

    def _stream_error(self, out: _Exchange, failure: Failure) -> None:
        out.chunk(_sse(None, self._error_body(failure)))

    @staticmethod
    def _finish_reason(reply: Reply) -> str:
        if reply.stop_reason is not None:
            return reply.stop_reason
        return "tool_calls" if reply.tool_calls else "stop"

    @staticmethod
    def _response_format(request: RecordedRequest) -> Any:
        body = request.body if isinstance(request.body, dict) else {}
        return body.get("response_format")

    def _refuse(self, request: RecordedRequest) -> Failure | None:
        form = self._response_format(request)
        if form is None:
            return None
        if not isinstance(form, dict) or form.get("type") not in (
            "text",
            "json_object",
            "json_schema",
        ):
            return Failure(400, f"response_format: unknown form {form!r}")
        if form["type"] != "json_schema":
            return None
        spec = form.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            return Failure(400, "response_format.json_schema needs a name")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            return Failure(400, "response_format.json_schema.schema must be an object")
        if schema.get("type") != "object":
            return Failure(
                400,
                f"Invalid schema for response_format {spec['name']!r}: schema must be a JSON "
                f"Schema of 'type: \"object\"', got 'type: \"{schema.get('type')}\"'.",
            )
        if spec.get("strict") is True:
            problem = _strict_problem(schema, "schema")
            if problem is not None:
                return Failure(
                    400, f"invalid schema for response_format {spec['name']!r}: {problem}"
                )
        return None

    def _shape(self, reply: Reply, request: RecordedRequest) -> Reply:
        form = self._response_format(request)
        if not isinstance(form, dict) or form.get("type") != "json_schema" or reply.tool_calls:
            return reply
        if reply.refusal is not None:
            return reply
        return dataclasses.replace(reply, text=[reply.structured_json])

    def _usage(self, reply: Reply) -> dict[str, Any]:
        return {
            "prompt_tokens": reply.input_tokens,
            "completion_tokens": reply.output_tokens,
            "total_tokens": reply.input_tokens + reply.output_tokens,
            "prompt_tokens_details": {"cached_tokens": reply.cache_read_tokens},
        }

    def _message(self, reply: Reply, request: RecordedRequest) -> Any:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reply.full_text or None,
            "refusal": reply.refusal,
        }
        if reply.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for c in reply.tool_calls
            ]
        answer = {
            "id": self._new_id("chatcmpl-fake"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self._model(reply, request),
            "choices": [
                {"index": 0, "message": message, "finish_reason": self._finish_reason(reply)}
            ],
        }
        if reply.report_usage:
            answer["usage"] = self._usage(reply)
        return answer

    def _events(self, reply: Reply, request: RecordedRequest) -> Iterator[bytes]:
        base = {
            "id": self._new_id("chatcmpl-fake"),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self._model(reply, request),
        }

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return _sse(None, {**base, "choices": [choice]})

        yield chunk({"role": "assistant", "content": ""})
        if reply.refusal is not None:
            yield chunk({"refusal": reply.refusal})
        for text in reply.deltas():
            yield chunk({"content": text})
        for index, call in enumerate(reply.tool_calls):
            head = {
                "index": index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            yield chunk({"tool_calls": [head]})
            for piece in self._split(reply.arguments_json(index)):
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        yield chunk({}, self._finish_reason(reply))
        options = request.body.get("stream_options") if isinstance(request.body, dict) else None
        if reply.report_usage and isinstance(options, dict) and options.get("include_usage"):
            yield _sse(None, {**base, "choices": [], "usage": self._usage(reply)})
        yield _sse(None, "[DONE]")


def _strict_problem(node: Any, where: str) -> str | None:
    """Why OpenAI's strict mode would refuse this schema node, or ``None``."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            problem = _strict_problem(item, f"{where}[{i}]")
            if problem is not None:
                return problem
        return None
    if not isinstance(node, dict):
        return None
    if "oneOf" in node:  # the real service: "'oneOf' is not permitted"
        return f"{where}: 'oneOf' is not permitted in strict mode"
    if "$ref" in node and len(node) > 1:
        return f"{where}: $ref cannot have keywords {sorted(set(node) - {'$ref'})}"
    if node.get("type") == "object" or "properties" in node:
        if node.get("additionalProperties") is not False:
            return f"{where}: additionalProperties must be false in strict mode"
        properties = node.get("properties") or {}
        missing = sorted(set(properties) - set(node.get("required") or ()))
        if missing:
            return f"{where}: strict mode needs every property required; missing {missing}"
    for key, value in node.items():
        if isinstance(value, dict | list) and key not in ("required", "enum", "const", "default"):
            problem = _strict_problem(value, f"{where}.{key}")
            if problem is not None:
                return problem
    return None
