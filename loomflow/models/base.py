"""The :class:`Model` protocol every model adapter implements, and :func:`complete`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from ..errors import ModelError
from ..messages import Message, ModelChunk, ModelResponse, ModelSettings, ToolSpec

__all__ = ["Model", "complete"]


@runtime_checkable
class Model(Protocol):
    """A chat model that streams its answer.

    ``stream`` yields :class:`~loomflow.messages.TextDelta` and
    :class:`~loomflow.messages.ToolCallDelta` chunks and ends with exactly one
    :class:`~loomflow.messages.ModelResponse`. The agent loop journals the call through
    ``runtime.stream_step``, so every chunk must be a codec-encodable value (the types in
    :mod:`loomflow.messages` are).
    """

    @property
    def name(self) -> str:
        """The model id sent to the provider, e.g. ``"claude-opus-4-7"``."""
        ...

    @property
    def provider(self) -> str:
        """A short, bounded label (``"anthropic"``, ``"openai"``, ``"scripted"``) for metrics."""
        ...

    def stream(
        self,
        messages: list[Message],
        *,
        tools: list[ToolSpec],
        settings: ModelSettings,
    ) -> AsyncIterator[ModelChunk]:
        """Stream one answer to ``messages``; the last chunk is the ``ModelResponse``."""
        ...


async def complete(
    model: Model,
    messages: list[Message],
    *,
    tools: Sequence[ToolSpec] = (),
    settings: ModelSettings | None = None,
) -> ModelResponse:
    """Run ``model.stream`` to the end and return its final :class:`ModelResponse`.

    Example:
        >>> response = await complete(model, [Message.user("hi")])  # doctest: +SKIP
    """
    chunks = model.stream(list(messages), tools=list(tools), settings=settings or ModelSettings())
    response: ModelResponse | None = None
    try:
        async for chunk in chunks:
            if isinstance(chunk, ModelResponse):
                response = chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    if response is None:
        raise ModelError(model.provider, model.name, "the stream ended without a ModelResponse")
    return response
