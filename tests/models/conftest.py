"""Fake provider servers and fast retry settings for the model adapter tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loomflow.models import Backoff
from loomflow.testing.providers import FakeAnthropicAPI, FakeOpenAIAPI


@pytest.fixture
def fast() -> Backoff:
    """Millisecond backoff: retry tests stay fast but still go through the sleep path."""
    return Backoff(initial=0.001, maximum=0.005)


@pytest.fixture
def anthropic_api() -> Iterator[FakeAnthropicAPI]:
    with FakeAnthropicAPI() as api:
        yield api


@pytest.fixture
def openai_api() -> Iterator[FakeOpenAIAPI]:
    with FakeOpenAIAPI() as api:
        yield api


@pytest.fixture(autouse=True)
def _no_provider_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests must reach only the local fakes, whatever the developer's shell exports.
    for name in (
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_AUTH_TOKEN",
        "ANTHROPIC_BASE_URL",
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
    ):
        monkeypatch.delenv(name, raising=False)
