"""The price table and cost_usd."""

from __future__ import annotations

import pytest

from loomflow.errors import InvalidArgumentError, InvalidArgumentTypeError
from loomflow.messages import Usage
from loomflow.models import PRICES, ModelPrice, cost_usd, price_for
from loomflow.models.pricing import normalize_prices

MILLION_EACH = Usage(input_tokens=1_000_000, output_tokens=1_000_000)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("claude-opus-4-7", 30.0),
        ("claude-sonnet-4-6", 18.0),
        ("claude-haiku-4-5", 6.0),
        ("gpt-4.1", 10.0),
        ("gpt-4o-mini", 0.75),
        ("o4-mini", 5.5),
    ],
)
def test_known_models(model: str, expected: float) -> None:
    assert cost_usd(model, MILLION_EACH) == pytest.approx(expected)


def test_input_and_output_are_priced_separately() -> None:
    assert cost_usd("claude-opus-4-7", Usage(input_tokens=2_000)) == pytest.approx(0.01)
    assert cost_usd("claude-opus-4-7", Usage(output_tokens=2_000)) == pytest.approx(0.05)


@pytest.mark.parametrize(
    "alias",
    [
        "claude-haiku-4-5-20251001",
        "anthropic:claude-haiku-4-5",
        "CLAUDE-HAIKU-4-5",
        "claude-haiku-4-5[1m]",
    ],
)
def test_snapshots_and_prefixes_price_as_the_base_model(alias: str) -> None:
    assert price_for(alias) == PRICES["claude-haiku-4-5"]


def test_a_dated_openai_snapshot_is_not_confused_with_a_sibling() -> None:
    assert price_for("gpt-4o-2024-08-06") == PRICES["gpt-4o"]
    assert price_for("gpt-4o-mini-2024-07-18") == PRICES["gpt-4o-mini"]
    assert price_for("gpt-4o-audio-preview") is None


def test_unknown_models_have_no_price() -> None:
    assert cost_usd("llama-3-70b", MILLION_EACH) is None


@pytest.mark.parametrize("name", ["scripted", "test", "function"])
def test_scripted_models_are_free(name: str) -> None:
    assert cost_usd(name, MILLION_EACH) == 0.0


def test_any_model_of_the_scripted_provider_is_free() -> None:
    assert cost_usd("my-fake-bot", MILLION_EACH, provider="scripted") == 0.0


def test_a_custom_table_can_be_passed() -> None:
    table = {"house-model": ModelPrice(1.0, 2.0)}
    assert cost_usd("house-model", MILLION_EACH, prices=table) == pytest.approx(3.0)
    assert cost_usd("claude-opus-4-7", MILLION_EACH, prices=table) is None


def test_the_table_cannot_be_edited_by_accident() -> None:
    with pytest.raises(TypeError):
        PRICES["gpt-4.1"] = ModelPrice(0, 0)  # type: ignore[index]


def test_a_custom_table_is_keyed_as_names_are_looked_up() -> None:
    # Case, a provider prefix and a date suffix are ignored in the keys as in the names.
    table = {"House-Model-2025-01-01": ModelPrice(1.0, 2.0), "openai:Other": ModelPrice(3.0, 4.0)}
    assert cost_usd("house-model", MILLION_EACH, prices=table) == pytest.approx(3.0)
    assert price_for("HOUSE-MODEL-20260101", prices=table) == ModelPrice(1.0, 2.0)
    assert price_for("other", prices=table) == ModelPrice(3.0, 4.0)
    assert normalize_prices(table) == {
        "house-model": ModelPrice(1.0, 2.0),
        "other": ModelPrice(3.0, 4.0),
    }


def test_keys_naming_one_model_with_two_prices_are_refused() -> None:
    table = {"House-Model": ModelPrice(1.0, 2.0), "house-model-2025-01-01": ModelPrice(1.0, 3.0)}
    with pytest.raises(InvalidArgumentError, match="'House-Model' and 'house-model-2025-01-01'"):
        price_for("house-model", prices=table)
    with pytest.raises(InvalidArgumentTypeError):
        normalize_prices({1: ModelPrice(1.0, 2.0)})  # type: ignore[dict-item]


def test_a_call_is_priced_as_the_model_that_answered_if_the_table_knows_it() -> None:
    assert price_for("gpt-4o", reported="gpt-4o-mini-2024-07-18") == PRICES["gpt-4o-mini"]
    # A gateway's own name for the model: priced as the model asked for.
    assert price_for("gpt-4o", reported="openai/gpt-4o") == PRICES["gpt-4o"]
    assert cost_usd("gpt-4o", MILLION_EACH, reported="openai/gpt-4o") == pytest.approx(12.5)
    assert price_for("llama-3-70b", reported="llama-3-70b-instruct") is None
    # The scripted provider stays free, whatever its responses say.
    assert price_for("scripted", provider="scripted", reported="gpt-4o") == ModelPrice(0, 0, 0, 0)


@pytest.mark.parametrize("reported", ["test", "scripted", "function", "Test", "openai:test"])
def test_a_reported_scripted_name_never_makes_a_real_call_free(reported: str) -> None:
    # The provider's answer naming a scripted model once priced a real call at $0.
    assert price_for("gpt-4.1", provider="openai", reported=reported) == PRICES["gpt-4.1"]
    assert cost_usd("gpt-4.1", MILLION_EACH, reported=reported) == pytest.approx(10.0)
    # Unknown requested model: unknown price, not free.
    assert price_for("inhouse-1", provider="openai", reported=reported) is None
    # A scripted model itself is still free.
    assert price_for("test", reported=reported) == ModelPrice(0, 0, 0, 0)
    assert price_for("gpt-4o", provider="scripted", reported=reported) == ModelPrice(0, 0, 0, 0)
