"""List prices of model calls, in USD per million tokens.

The figures are the providers' public list prices for standard (non-batch) input and output
tokens, read in November 2026 from Anthropic's pricing page
(platform.claude.com/docs/en/about-claude/pricing) and OpenAI's pricing page
(developers.openai.com/api/docs/pricing). They change: treat :func:`cost_usd` as an estimate
for budgets and dashboards, not as an invoice, and pass your own table where it matters.

Prompt-cache tokens have their own rates. Anthropic bills a cache read at a tenth of the input
rate and a cache write (five-minute lifetime) at 1.25 times it; OpenAI bills cached input at a
model-dependent fraction of the input rate and writes the cache for free (at the input rate).
A :class:`ModelPrice` without cache rates bills cache tokens as plain input.

Models priced by prompt length (e.g. Claude Haiku 5.5) are left out rather than mispriced.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import InvalidArgumentError, InvalidArgumentTypeError
from ..messages import Usage

__all__ = [
    "FREE_MODELS",
    "ModelPrice",
    "PRICES",
    "cost_usd",
    "normalize_prices",
    "price_for",
]

log = logging.getLogger("loomflow.pricing")


@dataclass(frozen=True)
class ModelPrice:
    """USD per million tokens: input, output, and prompt-cache reads and writes.

    ``cache_read_per_mtok`` and ``cache_write_per_mtok`` default to the input rate (``None``).
    """

    input_per_mtok: float
    output_per_mtok: float
    cache_read_per_mtok: float | None = None
    cache_write_per_mtok: float | None = None

    @property
    def cache_read_rate(self) -> float:
        """USD per million input tokens read from a prompt cache."""
        return self.input_per_mtok if self.cache_read_per_mtok is None else self.cache_read_per_mtok

    @property
    def cache_write_rate(self) -> float:
        """USD per million input tokens written to a prompt cache."""
        if self.cache_write_per_mtok is None:
            return self.input_per_mtok
        return self.cache_write_per_mtok

    @property
    def max_input_rate(self) -> float:
        """The highest rate an input token can cost (what a reservation must assume)."""
        return max(self.input_per_mtok, self.cache_read_rate, self.cache_write_rate)

    def cost(self, usage: Usage) -> float:
        """The cost of ``usage`` at this price, each kind of input token at its own rate."""
        return (
            usage.uncached_input_tokens * self.input_per_mtok
            + usage.cache_read_tokens * self.cache_read_rate
            + usage.cache_write_tokens * self.cache_write_rate
            + usage.output_tokens * self.output_per_mtok
        ) / 1_000_000


def _anthropic(input_per_mtok: float, output_per_mtok: float) -> ModelPrice:
    # Cache reads at 0.1x the input rate, five-minute cache writes at 1.25x.
    return ModelPrice(
        input_per_mtok,
        output_per_mtok,
        round(input_per_mtok * 0.1, 6),
        round(input_per_mtok * 1.25, 6),
    )


def _openai(input_per_mtok: float, output_per_mtok: float, cached_per_mtok: float) -> ModelPrice:
    # Cached input at its listed rate; writing the cache costs nothing extra.
    return ModelPrice(input_per_mtok, output_per_mtok, cached_per_mtok, input_per_mtok)


_ANTHROPIC = {
    "claude-fable-5-1": _anthropic(10.0, 50.0),
    "claude-fable-5": _anthropic(10.0, 50.0),
    "claude-opus-5-5": _anthropic(4.0, 20.0),
    "claude-opus-5": _anthropic(5.0, 25.0),
    "claude-opus-4-8": _anthropic(5.0, 25.0),
    "claude-opus-4-7": _anthropic(5.0, 25.0),
    "claude-opus-4-6": _anthropic(5.0, 25.0),
    "claude-opus-4-5": _anthropic(5.0, 25.0),
    "claude-sonnet-5-5": _anthropic(2.0, 10.0),
    "claude-sonnet-5": _anthropic(2.0, 10.0),
    "claude-sonnet-4-6": _anthropic(3.0, 15.0),
    "claude-sonnet-4-5": _anthropic(3.0, 15.0),
    "claude-haiku-4-5": _anthropic(1.0, 5.0),
}

_OPENAI = {
    "gpt-5.4": _openai(2.5, 15.0, 0.25),
    "gpt-5.2": _openai(1.75, 14.0, 0.175),
    "gpt-5.1": _openai(1.25, 10.0, 0.125),
    "gpt-5": _openai(1.25, 10.0, 0.125),
    "gpt-5-mini": _openai(0.25, 2.0, 0.025),
    "gpt-5-nano": _openai(0.05, 0.4, 0.005),
    "gpt-4.1": _openai(2.0, 8.0, 0.5),
    "gpt-4.1-mini": _openai(0.4, 1.6, 0.1),
    "gpt-4.1-nano": _openai(0.1, 0.4, 0.025),
    "gpt-4o": _openai(2.5, 10.0, 1.25),
    "gpt-4o-mini": _openai(0.15, 0.6, 0.075),
    "o3": _openai(2.0, 8.0, 0.5),
    "o4-mini": _openai(1.1, 4.4, 0.275),
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


_FREE = ModelPrice(0.0, 0.0, 0.0, 0.0)


class _Normalized(dict[str, ModelPrice]):
    """A price table whose keys are already normalised (what :func:`normalize_prices` returns)."""


def normalize_prices(prices: Mapping[str, ModelPrice]) -> Mapping[str, ModelPrice]:
    """``prices`` keyed the way :func:`price_for` looks names up (lower case, no provider prefix
    or date suffix), so ``{"My-Model-2025-01-01": ...}`` prices ``"my-model"``.

    Raises:
        InvalidArgumentTypeError: ``prices`` is not a mapping, a key is not a string or a
            price is not a :class:`ModelPrice`.
        InvalidArgumentError: two keys name the same model (``"My-Model"`` and ``"my-model"``)
            with different prices.
    """
    if isinstance(prices, _Normalized):
        return prices
    if not isinstance(prices, Mapping):
        raise InvalidArgumentTypeError(
            f"prices must be a mapping of model id to ModelPrice, not {prices!r}"
        )
    table = _Normalized()
    given: dict[str, str] = {}  # normalised name -> the key it came from
    for key, price in prices.items():
        if not isinstance(key, str):
            raise InvalidArgumentTypeError(f"price table keys must be model ids, not {key!r}")
        if not isinstance(price, ModelPrice):
            raise InvalidArgumentTypeError(
                f"the price of {key!r} must be a ModelPrice(input_per_mtok, output_per_mtok), "
                f"not {price!r}"
            )
        name = _normalize(key)
        if name in table and table[name] != price:
            raise InvalidArgumentError(
                f"price table keys {given[name]!r} and {key!r} both name model {name!r} but "
                f"give it different prices ({table[name]} and {price})"
            )
        table[name] = price
        given.setdefault(name, key)
    return table


def price_for(
    model_name: str,
    *,
    provider: str | None = None,
    prices: Mapping[str, ModelPrice] | None = None,
    reported: str | None = None,
) -> ModelPrice | None:
    """The price of a call to ``model_name``, or ``None`` when the table does not know it.

    The one pricing rule of a model call, shared by the budget, ``RunResult.cost_usd``, the
    audit trail and the metrics: the call is priced as the model that answered
    (``reported``) when the table knows it, and as the model asked for otherwise (a gateway
    that answers ``"openai/gpt-4o"`` to a request for ``"gpt-4o"`` bills ``gpt-4o``). A
    reported name of a scripted model (:data:`FREE_MODELS`) is ignored: only the model asked
    for, or a ``"scripted"`` provider, makes a call free.

    Args:
        model_name: The model id the call asked for (``"claude-opus-4-7"``,
            ``"openai:gpt-4o"``, ``"gpt-4o-2024-08-06"``).
        provider: The model's provider label; ``"scripted"`` is always free, whatever the name.
        prices: A table to use instead of :data:`PRICES`; its keys are normalised as the
            names are (see :func:`normalize_prices`).
        reported: The model id the provider's response names, if any.
    """
    if provider == "scripted":
        return _FREE
    table = PRICES if prices is None else normalize_prices(prices)
    # A reported scripted-model name ("test") never makes a call free: what the provider's
    # response says is data from outside, and a real call priced at $0 would never trip a
    # cost cap. Such a call is priced as the model asked for.
    answered = _normalize(reported) if reported else None
    if answered is not None and answered not in FREE_MODELS:
        found = table.get(answered)
        if found is not None:
            return found
    return _lookup(_normalize(model_name), table) if model_name else None


def _lookup(name: str, table: Mapping[str, ModelPrice]) -> ModelPrice | None:
    return _FREE if name in FREE_MODELS else table.get(name)


def cost_usd(
    model_name: str,
    usage: Usage,
    *,
    provider: str | None = None,
    prices: Mapping[str, ModelPrice] | None = None,
    reported: str | None = None,
) -> float | None:
    """Estimated USD cost of ``usage`` on a call to ``model_name`` (priced as
    :func:`price_for` says): 0 for scripted models, ``None`` if the price is unknown.

    Example:
        >>> cost_usd("claude-opus-4-7", Usage(input_tokens=1_000_000, output_tokens=0))
        5.0
    """
    price = price_for(model_name, provider=provider, prices=prices, reported=reported)
    return None if price is None else price.cost(usage)


# Models already warned about, by normalised name: the loop (pricing the run) and the budget
# (pricing the call) both meet an unpriced model, and one warning says it all.
_unpriced: set[str] = set()


def warn_unpriced(model_name: str) -> None:
    """Log, once per process and model, that no price table knows ``model_name``: what that
    costs (its calls count $0) and how to price it."""
    name = _normalize(model_name)
    if name in _unpriced:
        return
    _unpriced.add(name)
    log.warning(
        "no price is known for model %r: its calls count $0 of cost in RunResult.cost_usd, "
        "the audit trail, the metrics and budget totals (a budget still counts their tokens; "
        "a cost_usd cap refuses them). Price it with StandardBudget(prices={%r: "
        "ModelPrice(input_usd_per_mtok, output_usd_per_mtok)}) or "
        "Agent.from_settings(..., prices={...}); ModelPrice is in loomflow.models.pricing",
        model_name,
        model_name,
    )
