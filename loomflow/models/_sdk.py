"""What the provider adapters share: building the SDK client, closing it, retrying streams."""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
import random
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, ClassVar, Generic, Self, TypeVar
from urllib.parse import urlsplit

from ..config import _masked_url
from ..errors import ConfigurationError, InvalidArgumentError, UntrustedUsageError
from ..messages import (
    MAX_TOKENS_PER_CALL,
    Message,
    ModelChunk,
    ModelSettings,
    OutputFormat,
    ToolSpec,
)
from ._retry import Backoff, Failure, stream_with_retries, transport_errors

__all__ = ["SdkModel"]

logger = logging.getLogger("loomflow.models")

ClientT = TypeVar("ClientT")

# (provider, model) pairs already warned about answering without token counts.
_unreported: set[tuple[str, str]] = set()


class SdkModel(abc.ABC, Generic[ClientT]):
    """A model served through an official provider SDK's async client.

    The client is built the SDK's standard way, so its own environment variables work
    unchanged; ``base_url=``/``api_key=`` override them, or a ready client is used as given (a
    copy with the SDK's retries off; the original stays the caller's to close). Transient
    failures are retried here, with backoff, only before the first chunk has been yielded.
    """

    provider: ClassVar[str]
    _label: ClassVar[str]  # the provider's name in messages, e.g. "Anthropic"
    # The client's credential attributes, with where each comes from (for the error on a bad one).
    _credentials: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Why a response may come without token counts, for the warning when none came.
    _usage_hint: ClassVar[str] = ""
    # ``stream`` takes ``output=``: the provider itself is asked for an answer of that shape.
    native_output: ClassVar[bool] = True

    def __init__(
        self,
        model: str,
        *,
        client: ClientT | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        max_retries: int = 3,
        backoff: Backoff | None = None,
        timeout: float | None = None,
    ) -> None:
        sdk = self._import_sdk()
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise InvalidArgumentError(f"max_retries must be an integer >= 0, not {max_retries!r}")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            # Left to the SDK, NaN failed the first call with a bare ValueError and 0 or less
            # "timed out" on every attempt, retried until the retries ran out.
            raise InvalidArgumentError(
                f"timeout must be a finite number of seconds above 0 (or None), not {timeout!r}"
            )
        self._name = model
        self._sdk = sdk
        self._owns_client = client is None
        options: dict[str, Any] = {"max_retries": 0}
        if timeout is not None:
            options["timeout"] = timeout
        if client is None:
            # Only explicit values are passed: the SDK reads its environment for the rest.
            if base_url is not None:
                options["base_url"] = base_url
            if api_key is not None:
                options["api_key"] = api_key
            build_errors: tuple[type[BaseException], ...] = (*self._sdk_errors(sdk), ValueError)
            try:
                self._client: ClientT = self._new_client(sdk, options)
            except build_errors as exc:
                # E.g. no API key anywhere: say so when the model is built, as a loomflow error.
                raise ConfigurationError(
                    f"cannot build the {self._label} client for model {model!r}: {exc}"
                ) from exc
        else:
            # A copy sharing the caller's connection pool, with the SDK retries off.
            self._client = client.with_options(**options)  # type: ignore[attr-defined]
        self._check_credentials()
        self._check_base_url()
        self.max_retries = max_retries
        self.backoff = backoff or Backoff()
        self._rng = random.Random()
        self._transport_errors = transport_errors()
        # A lost connection, as the SDK or the HTTP library under it raises it.
        self._connection_errors = (sdk.APIConnectionError, *self._transport_errors)

    # -- provider hooks ----------------------------------------------------------------------

    @staticmethod
    @abc.abstractmethod
    def _import_sdk() -> Any:
        """Import the SDK, or raise ImportError naming the extra to install."""

    @abc.abstractmethod
    def _new_client(self, sdk: Any, options: dict[str, Any]) -> ClientT: ...

    @abc.abstractmethod
    def _sdk_errors(self, sdk: Any) -> tuple[type[BaseException], ...]: ...

    @abc.abstractmethod
    def _request(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        settings: ModelSettings,
        output: OutputFormat | None,
    ) -> dict[str, Any]:
        """The SDK call's keyword arguments."""

    @abc.abstractmethod
    def _attempt(
        self, request: dict[str, Any], output: OutputFormat | None
    ) -> AsyncGenerator[ModelChunk, None]:
        """One streamed attempt."""

    @abc.abstractmethod
    def _classify(self, exc: Exception) -> Failure | None:
        """Describe a failure (retryable or not), or ``None`` if it is not the provider's."""

    # -- shared behaviour --------------------------------------------------------------------

    def _check_base_url(self) -> None:
        """Refuse a base URL that is not http(s) with a host (its password masked in the error).

        "localhost:8000/v1" failed every call inside the HTTP library as a "connection
        failure" (an unsupported protocol), retried until the retries ran out.
        """
        url = str(getattr(self._client, "base_url", ""))
        parts = urlsplit(url)
        if parts.scheme in ("http", "https") and parts.hostname:
            return
        raise ConfigurationError(
            f"the {self._label} base URL (base_url= or {self.provider.upper()}_BASE_URL) "
            f"{_masked_url(url)!r} is not an http(s) URL like https://llm-proxy.internal/v1"
        )

    def _check_credentials(self) -> None:
        """Refuse a key that no request can carry, naming where it came from but not its text.

        Sent as it is, a key read from a file with its newline (or pasted with a quote) failed
        every call inside the HTTP library: a "connection failure", retried until the retries
        ran out, or a bare UnicodeEncodeError.
        """
        for attribute, source in self._credentials:
            key = getattr(self._client, attribute, None)
            if not isinstance(key, str) or not key:
                continue
            if any(c.isspace() or not c.isprintable() for c in key):
                problem = "holds white space or a control character (a newline read with it?)"
            elif not key.isascii():
                problem = "holds a character that is not ASCII (a quote pasted with it?)"
            else:
                continue
            raise ConfigurationError(
                f"the {self._label} key ({source}) {problem}: no request can carry it"
            )

    def _classify_redacted(self, exc: Exception) -> Failure | None:
        """:meth:`_classify`, with the client's credentials cut out of the detail.

        Some gateways quote the key they refused ("Incorrect API key provided: sk-..."); the
        detail becomes the ModelError's message, which logs and the audit trail keep.
        """
        failure = self._classify(exc)
        if failure is None:
            return None
        detail = failure.detail
        for name in ("api_key", "auth_token"):
            secret = getattr(self._client, name, None)
            # A key of a few characters (a test's "k") would cut letters out of every word.
            if isinstance(secret, str) and len(secret.strip()) >= 8:
                detail = detail.replace(secret.strip(), "[api key]")
        if detail == failure.detail:
            return failure
        return dataclasses.replace(failure, detail=detail, conceal_cause=True)

    def _reported_count(self, field: str, value: Any) -> int:
        """A token count from the provider's usage: a missing one is 0; one that cannot be true
        (negative, not an integer) raises :class:`UntrustedUsageError` rather than being
        clamped, so that a budget charges the call's whole reservation instead of the figure.
        """
        if value is None:
            return 0
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UntrustedUsageError(
                f"{self.provider} model {self._name!r} reported {field}={value!r}, which cannot "
                "be a token count; what the call spent is unknown"
            )
        if value > MAX_TOKENS_PER_CALL:
            # Refused here, before the response is journaled: a kept one would make every
            # resume replay the figure into the run's result (a cost of millions).
            raise UntrustedUsageError(
                f"{self.provider} model {self._name!r} reported {field}={value}, more than any "
                f"call reads or writes (over {MAX_TOKENS_PER_CALL:,}); what it spent is unknown"
            )
        return value

    def _warn_usage_unreported(self) -> None:
        """Say once per model that a response came without token counts."""
        key = (self.provider, self._name)
        if key not in _unreported:
            _unreported.add(key)
            logger.warning(
                "%s model %r answered without reporting its token usage%s: such a call "
                "counts as 0 tokens in a run's totals, and a budget charges its whole "
                "reservation",
                self.provider,
                self._name,
                self._usage_hint,
            )

    @property
    def name(self) -> str:
        """The model id sent to the API."""
        return self._name

    @property
    def client(self) -> ClientT:
        """The SDK client in use."""
        return self._client

    async def aclose(self) -> None:
        """Close the client if this adapter built it."""
        if self._owns_client:
            await self._client.close()  # type: ignore[attr-defined]

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def stream(
        self,
        messages: list[Message],
        *,
        tools: Sequence[ToolSpec] = (),
        settings: ModelSettings | None = None,
        output: OutputFormat | None = None,
    ) -> AsyncIterator[ModelChunk]:
        """Stream the model's answer; the last chunk is the ``ModelResponse``.

        With ``output``, the provider is asked for an answer of that shape (natively: see
        ``docs/structured-output.md``), and the answer's JSON is the response's ``text``.
        """
        request = _sendable(
            self._request(messages, list(tools), settings or ModelSettings(), output)
        )
        return stream_with_retries(
            lambda: self._attempt(request, output),
            self._classify_redacted,
            provider=self.provider,
            model=self._name,
            max_retries=self.max_retries,
            backoff=self.backoff,
            rng=self._rng,
        )


def _sendable(value: Any) -> Any:
    """``value`` with every string made valid Unicode, as a request body must be (UTF-8).

    A lone surrogate cannot be encoded: a tool result naming a file whose name is not UTF-8
    (``os.listdir`` gives ``"caf\\udce9"``) failed the next call with a bare
    UnicodeEncodeError inside the SDK. It is sent as U+FFFD (a surrogate pair, as the character
    it stands for). Done at send time, so the journal key of the call stays as it was.
    """
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return value
    if isinstance(value, dict):
        return {_sendable(k): _sendable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_sendable(item) for item in value]
    return value
