"""Prompt-cache reads and writes: parsed apart by the real SDKs' adapters, priced at their own
rates, and decoded from journal rows written before the fields existed."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from loomflow.errors import UntrustedUsageError
from loomflow.messages import Message, ModelResponse, ModelSettings, Usage
from loomflow.models import AnthropicModel, Backoff, OpenAIModel, complete, cost_usd
from loomflow.models.pricing import PRICES, ModelPrice, price_for
from loomflow.runtime.codec import decode, encode
from loomflow.testing.providers import FakeAnthropicAPI, FakeOpenAIAPI, Reply


async def test_anthropic_cache_reads_and_writes_are_input_kept_apart(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    # Anthropic's input_tokens leaves the cache out; the adapter adds both cache figures in.
    anthropic_api.add(
        Reply(text="Hi.", input_tokens=50, output_tokens=4, cache_read_tokens=3000,
              cache_write_tokens=800)
    )  # fmt: skip
    async with AnthropicModel(
        "claude-opus-4-7", base_url=anthropic_api.base_url, api_key="sk-test", backoff=fast
    ) as model:
        response = await complete(model, [Message.user("hi")])
    assert response.usage == Usage(
        input_tokens=3850, output_tokens=4, cache_read_tokens=3000, cache_write_tokens=800
    )
    assert response.usage.uncached_input_tokens == 50


async def test_openai_cached_tokens_are_part_of_prompt_tokens(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    openai_api.add(Reply(text="Hi.", input_tokens=2000, output_tokens=4, cache_read_tokens=1536))
    async with OpenAIModel(
        "gpt-4.1", base_url=openai_api.base_url, api_key="sk-test", backoff=fast
    ) as model:
        response = await complete(model, [Message.user("hi")], settings=ModelSettings())
    assert response.usage == Usage(input_tokens=2000, output_tokens=4, cache_read_tokens=1536)


async def test_openai_cached_tokens_beyond_the_prompt_are_clipped(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # A provider's figures are data from outside: an impossible cache count is clipped to the
    # prompt rather than failing the call after it was paid for.
    openai_api.add(Reply(text="Hi.", input_tokens=10, output_tokens=4, cache_read_tokens=99))
    async with OpenAIModel(
        "gpt-4.1", base_url=openai_api.base_url, api_key="sk-test", backoff=fast
    ) as model:
        response = await complete(model, [Message.user("hi")])
    assert response.usage.cache_read_tokens == 10


@pytest.mark.parametrize(
    ("provider", "field"),
    [
        ("openai", "input_tokens"),
        ("openai", "output_tokens"),
        ("openai", "cache_read_tokens"),
        ("anthropic", "input_tokens"),
        ("anthropic", "output_tokens"),
        ("anthropic", "cache_read_tokens"),
        ("anthropic", "cache_write_tokens"),
    ],
)
@pytest.mark.parametrize("bad", [-3, 10**12])
async def test_a_reported_count_that_cannot_be_true_is_not_trusted(
    anthropic_api: FakeAnthropicAPI,
    openai_api: FakeOpenAIAPI,
    fast: Backoff,
    provider: str,
    field: str,
    bad: int,
) -> None:
    # Clamped to 0 it would hide what the call spent from a budget: it raises instead (and
    # is not retried, which would bill a second call). An absurdly large one is refused in
    # the adapter too: journaled, every resume would replay it into the run's result.
    api: FakeAnthropicAPI | FakeOpenAIAPI = anthropic_api if provider == "anthropic" else openai_api
    await _not_trusted(api, fast, {"input_tokens": 10, "output_tokens": 4, field: bad}, f"={bad}")


async def _not_trusted(
    api: FakeAnthropicAPI | FakeOpenAIAPI, fast: Backoff, figures: dict[str, int], said: str
) -> None:
    """The call with these usage figures raises UntrustedUsageError, and is not retried."""
    api.add(Reply(text="Hi.", **figures))
    anthropic = isinstance(api, FakeAnthropicAPI)
    adapter = AnthropicModel if anthropic else OpenAIModel
    name = "claude-opus-4-7" if anthropic else "gpt-4.1"
    async with adapter(name, base_url=api.base_url, api_key="sk-test", backoff=fast) as model:
        with pytest.raises(UntrustedUsageError, match=said):
            await complete(model, [Message.user("hi")])
    assert api.request_count == 1


async def test_anthropic_input_parts_that_add_up_past_any_call_are_not_trusted(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    # Each part is plausible; their sum, the call's input_tokens, is not. It reached the
    # budget as a plain InvalidUsageError (ending the run rather than charging the hold).
    figures = {"input_tokens": 6_000_000, "cache_read_tokens": 6_000_000}
    await _not_trusted(anthropic_api, fast, figures, "cache_read_input_tokens=12000000")


async def test_zero_cache_figures_mean_no_cache(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    anthropic_api.add(Reply(text="Hi.", input_tokens=21, output_tokens=3))
    async with AnthropicModel(
        "claude-opus-4-7", base_url=anthropic_api.base_url, api_key="sk-test", backoff=fast
    ) as model:
        response = await complete(model, [Message.user("hi")])
    assert response.usage == Usage(input_tokens=21, output_tokens=3)


def test_anthropic_cache_rates_are_a_tenth_and_five_quarters_of_input() -> None:
    price = PRICES["claude-opus-4-7"]  # $5 in, $25 out per million
    assert price.cache_read_rate == pytest.approx(0.5)
    assert price.cache_write_rate == pytest.approx(6.25)
    usage = Usage(
        input_tokens=1_000_000 + 2_000_000 + 400_000,
        output_tokens=0,
        cache_read_tokens=2_000_000,
        cache_write_tokens=400_000,
    )
    # 1M uncached at $5, 2M read at $0.50, 0.4M written at $6.25.
    assert cost_usd("claude-opus-4-7", usage) == pytest.approx(5.0 + 1.0 + 2.5)
    # Folded into plain input it would have cost 3.4M x $5.
    assert cost_usd("claude-opus-4-7", Usage(input_tokens=3_400_000)) == pytest.approx(17.0)


def test_openai_cached_input_has_its_listed_rate_and_writes_cost_input() -> None:
    price = price_for("gpt-4.1")
    assert price is not None
    assert price.cache_read_rate == pytest.approx(0.5)
    assert price.cache_write_rate == price.input_per_mtok
    usage = Usage(input_tokens=1_000_000, cache_read_tokens=750_000)
    assert cost_usd("gpt-4.1", usage) == pytest.approx(0.25 * 2.0 + 0.75 * 0.5)


def test_every_price_has_cache_rates_no_dearer_than_reason() -> None:
    for name, price in PRICES.items():
        assert 0 <= price.cache_read_rate <= price.input_per_mtok, name
        assert price.input_per_mtok <= price.cache_write_rate <= 1.25 * price.input_per_mtok, name
        assert price.max_input_rate == price.cache_write_rate, name


def test_a_price_without_cache_rates_bills_cache_as_input() -> None:
    price = ModelPrice(2.0, 8.0)
    usage = Usage(input_tokens=1_000_000, cache_read_tokens=600_000, cache_write_tokens=100_000)
    assert price.cost(usage) == pytest.approx(2.0)


def test_cache_figures_are_part_of_input_and_add_up() -> None:
    with pytest.raises(ValidationError, match="part of input_tokens"):
        Usage(input_tokens=10, cache_read_tokens=8, cache_write_tokens=3)
    with pytest.raises(ValidationError):
        Usage(input_tokens=10, cache_read_tokens=-1)
    total = Usage(input_tokens=10, cache_read_tokens=4) + Usage(
        input_tokens=20, output_tokens=2, cache_write_tokens=5
    )
    assert total == Usage(
        input_tokens=30, output_tokens=2, cache_read_tokens=4, cache_write_tokens=5
    )
    assert sum([Usage(input_tokens=1, cache_read_tokens=1)] * 3) == Usage(
        input_tokens=3, cache_read_tokens=3
    )


def test_a_journaled_usage_from_before_the_cache_fields_decodes_with_zeros() -> None:
    # What a journal holds for a model call journaled by an earlier version: the usage object
    # has input and output tokens only (the journal stores the encoding as JSON).
    fresh = encode(ModelResponse(text="ok", usage=Usage(input_tokens=7, output_tokens=2)))
    fields = fresh["v"]["fields"]["usage"]["v"]["fields"]
    del fields["cache_read_tokens"], fields["cache_write_tokens"]
    old = json.loads(json.dumps(fresh))
    assert "cache_" not in json.dumps(old)
    decoded = decode(old)
    assert isinstance(decoded, ModelResponse)
    assert decoded.usage == Usage(input_tokens=7, output_tokens=2)
    assert decoded.usage.cache_read_tokens == 0
    assert decoded.usage.cache_write_tokens == 0


def test_a_journaled_usage_with_cache_figures_round_trips() -> None:
    usage = Usage(input_tokens=70, output_tokens=2, cache_read_tokens=50, cache_write_tokens=10)
    decoded = decode(encode(ModelResponse(text="ok", usage=usage)))
    assert isinstance(decoded, ModelResponse)
    assert decoded.usage == usage


def test_a_journaled_response_from_before_usage_reported_decodes_as_reported() -> None:
    fresh = encode(ModelResponse(text="ok", usage=Usage(input_tokens=7, output_tokens=2)))
    del fresh["v"]["fields"]["usage_reported"]
    decoded = decode(json.loads(json.dumps(fresh)))
    assert isinstance(decoded, ModelResponse)
    assert decoded.usage_reported is True
    assert decoded.usage == Usage(input_tokens=7, output_tokens=2)


def test_an_unreported_usage_round_trips_through_the_journal() -> None:
    response = ModelResponse(text="ok", usage_reported=False)
    decoded = decode(json.loads(json.dumps(encode(response))))
    assert decoded == response
    assert decoded.usage_reported is False


async def test_anthropic_input_counts_zeroed_in_message_delta_keep_the_start_figures(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    # message_delta's counts are cumulative, but some compatible servers send 0 there for
    # the input figures: the SDK took the 0, and the call's input cost nothing (a budget
    # charged only its output).
    def event(kind: str, data: dict[str, object]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    start_usage = {"input_tokens": 40, "cache_read_input_tokens": 900, "output_tokens": 1}
    message = {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-opus-4-7",
        "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage,
    }  # fmt: skip
    zeroed = {"input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 5}
    body = [
        event("message_start", {"message": message}),
        event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
        event("content_block_stop", {"index": 0}),
        event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": zeroed}),
        event("message_stop", {}),
    ]
    anthropic_api.add(Reply(raw_stream=body))
    async with AnthropicModel(
        "claude-opus-4-7", base_url=anthropic_api.base_url, api_key="sk-test", backoff=fast
    ) as model:
        response = await complete(model, [Message.user("hi")])
    assert response.usage == Usage(input_tokens=940, output_tokens=5, cache_read_tokens=900)
