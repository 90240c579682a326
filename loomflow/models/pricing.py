"""List prices of model calls, in USD per million tokens.

The figures are the providers' public list prices for standard (non-batch, uncached) input and
output tokens, read in November 2026 from Anthropic's pricing page
(platform.claude.com/docs/en/about-claude/pricing) and OpenAI's pricing page
(developers.openai.com/api/docs/pricing). They change: treat :func:`cost_usd` as an estimate
for budgets and dashboards, not as an invoice, and pass your own table where it matters.

Models priced by prompt length (e.g. Claude Haiku 5.5) are left out rather than mispriced.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..messages import Usage

__all__ = [
    "FREE_MODELS",
    "ModelPrice",
    "PRICES",
    "cost_usd",
    "price_for",
]


@dataclass(frozen=True)
class ModelPrice:
    """USD per million input and output tokens."""

    input_per_mtok: float
    output_per_mtok: float

    def cost(self, usage: Usage) -> float:
        """The cost of ``usage`` at this price."""
        return (
            usage.input_tokens * self.input_per_mtok + usage.output_tokens * self.output_per_mtok
        ) / 1_000_000


_ANTHROPIC = {
    "claude-fable-5-1": ModelPrice(10.0, 50.0),
    "claude-fable-5": ModelPrice(10.0, 50.0),
    "claude-opus-5-5": ModelPrice(4.0, 20.0),
    "claude-opus-5": ModelPrice(5.0, 25.0),
    "claude-opus-4-8": ModelPrice(5.0, 25.0),
    "claude-opus-4-7": ModelPrice(5.0, 25.0),
    "claude-opus-4-6": ModelPrice(5.0, 25.0),
    "claude-opus-4-5": ModelPrice(5.0, 25.0),
    "claude-sonnet-5-5": ModelPrice(2.0, 10.0),
    "claude-sonnet-5": ModelPrice(2.0, 10.0),
    "claude-sonnet-4-6": ModelPrice(3.0, 15.0),
    "claude-sonnet-4-5": ModelPrice(3.0, 15.0),
    "claude-haiku-4-5": ModelPrice(1.0, 5.0),
}

_OPENAI = {
    "gpt-5.4": ModelPrice(2.5, 15.0),
    "gpt-5.2": ModelPrice(1.75, 14.0),
    "gpt-5.1": ModelPrice(1.25, 10.0),
    "gpt-5": ModelPrice(1.25, 10.0),
    "gpt-5-mini": ModelPrice(0.25, 2.0),
    "gpt-5-nano": ModelPrice(0.05, 0.4),
    "gpt-4.1": ModelPrice(2.0, 8.0),
    "gpt-4.1-mini": ModelPrice(0.4, 1.6),
    "gpt-4.1-nano": ModelPrice(0.1, 0.4),
    "gpt-4o": ModelPrice(2.5, 10.0),
    "gpt-4o-mini": ModelPrice(0.15, 0.6),
    "o3": ModelPrice(2.0, 8.0),
    "o4-mini": ModelPrice(1.1, 4.4),
}

PRICES: Mapping[str, ModelPrice] = MappingProxyType({**_ANTHROPIC, **_OPENAI})
"""Built-in prices by model id (without date suffix)."""

FREE_MODELS = frozenset({"scripted", "test", "function"})
"""Names of the library's scripted models, which cost nothing."""

# Dated snapshots ("claude-haiku-4-5-20251001", "gpt-4o-2024-08-06") bill as their base model;
# a "[1m]" context-window suffix does not change the list price either.
_SNAPSHOT = re.compile(r"(-\d{8}|-\d{4}-\d{2}-\d{2}|\[1m\])$")
_PROVIDER_PREFIX = re.compile(r"^(anthropic|openai):")


def _normalize(model_name: str) -> str:
    name = _PROVIDER_PREFIX.sub("", model_name.strip().lower())
    return _SNAPSHOT.sub("", name)


_FREE = ModelPrice(0.0, 0.0)


def price_for(
    model_name: str,
    *,
    provider: str | None = None,
    prices: Mapping[str, ModelPrice] | None = None,
) -> ModelPrice | None:
    """The price of ``model_name``, or ``None`` when the table does not know it.

    Args:
        model_name: A model id as sent or reported (``"claude-opus-4-7"``, ``"openai:gpt-4o"``,
            ``"gpt-4o-2024-08-06"``).
        provider: The model's provider label; ``"scripted"`` is always free, whatever the name.
        prices: A table to use instead of :data:`PRICES`.
    """
    name = _normalize(model_name)
    if provider == "scripted" or name in FREE_MODELS:
        return _FREE
    return (PRICES if prices is None else prices).get(name)


def cost_usd(
    model_name: str,
    usage: Usage,
    *,
    provider: str | None = None,
    prices: Mapping[str, ModelPrice] | None = None,
) -> float | None:
    """Estimated USD cost of ``usage`` on ``model_name``: 0 for scripted models, ``None`` if
    the price is unknown.

    Example:
        >>> cost_usd("claude-opus-4-7", Usage(input_tokens=1_000_000, output_tokens=0))
        5.0
    """
    price = price_for(model_name, provider=provider, prices=prices)
    return None if price is None else price.cost(usage)
