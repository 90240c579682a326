"""Tool-call arguments that JSON cannot carry, or that nest too deep or were cut off, and error
bodies too large to repeat, through both real SDKs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loomflow.errors import ModelError, ModelRetryExhaustedError
from loomflow.messages import Message, ToolCall
from loomflow.models import AnthropicModel, Backoff, OpenAIModel, complete
from loomflow.models._sdk import SdkModel
from loomflow.testing.providers import (
    Failure,
    FakeAnthropicAPI,
    FakeOpenAIAPI,
    FakeProviderAPI,
    Reply,
)

CALL = ToolCall(id="call_01", name="get_weather", arguments={})

BOTH_PROVIDERS = pytest.mark.parametrize(
    ("api_type", "model_type"),
    [(FakeAnthropicAPI, AnthropicModel), (FakeOpenAIAPI, OpenAIModel)],
    ids=["anthropic", "openai"],
)


@BOTH_PROVIDERS
@pytest.mark.parametrize(
    ("raw", "said"),
    [
        # NaN compares false to everything: a rule like args={"days": lambda v: v > 7}
        # would let it through. JSON has neither it nor Infinity.
        ('{"days": NaN}', "not a JSON object"),
        ('{"days": -Infinity}', "not a JSON object"),
        # Deep enough to end the run in the journal (or in a RecursionError) once paid for.
        ('{"days": ' + "[" * 97 + "]" * 97 + "}", "nested more than 64 levels deep"),
        # This deep, the Anthropic SDK's own parser gives up first.
        ('{"days": ' + "[" * 900 + "]" * 900 + "}", "nested more than 64|could not read"),
    ],
    ids=["nan", "infinity", "deep", "deeper-than-json-reads"],
)
async def test_tool_arguments_json_cannot_carry_are_a_model_error(
    api_type: type[FakeAnthropicAPI | FakeOpenAIAPI],
    model_type: type[AnthropicModel | OpenAIModel],
    fast: Backoff,
    raw: str,
    said: str,
) -> None:
    with api_type() as api:
        api.add(Reply(tool_calls=[CALL], raw_arguments=[raw]))
        async with model_type("m", base_url=api.base_url, api_key="k", backoff=fast) as model:
            with pytest.raises(ModelError, match=said) as info:
                await complete(model, [Message.user("hi")])
        assert not isinstance(info.value, ModelRetryExhaustedError)
        assert api.request_count == 1  # not retried: the same model would say the same


@pytest.mark.parametrize(
    ("api_type", "model_type", "stop_reason"),
    [(FakeAnthropicAPI, AnthropicModel, "max_tokens"), (FakeOpenAIAPI, OpenAIModel, "length")],
    ids=["anthropic", "openai"],
)
async def test_arguments_cut_by_max_tokens_say_so(
    api_type: type[FakeAnthropicAPI | FakeOpenAIAPI],
    model_type: type[AnthropicModel | OpenAIModel],
    stop_reason: str,
    fast: Backoff,
) -> None:
    # The default max_tokens (1024) cuts a long tool input (a file to write) mid-JSON: the
    # error blamed the model's JSON, when what to raise is ModelSettings.max_tokens.
    with api_type() as api:
        api.add(Reply(tool_calls=[CALL], raw_arguments=['{"days": [1, 2'], stop_reason=stop_reason))
        api.add(Reply(tool_calls=[CALL], raw_arguments=['{"days": [1, 2']))
        async with model_type("m", base_url=api.base_url, api_key="k", backoff=fast) as model:
            with pytest.raises(ModelError, match="not a JSON object") as cut:
                await complete(model, [Message.user("hi")])
            with pytest.raises(ModelError, match="not a JSON object") as malformed:
                await complete(model, [Message.user("hi")])
    assert "max_tokens" in str(cut.value)
    assert "max_tokens" not in str(malformed.value)  # not cut: the model's JSON is at fault
    assert api.request_count == 2  # neither retried: the same request is cut the same way


@BOTH_PROVIDERS
async def test_a_huge_error_body_is_clipped_in_the_error(
    api_type: type[FakeAnthropicAPI | FakeOpenAIAPI],
    model_type: type[AnthropicModel | OpenAIModel],
    fast: Backoff,
) -> None:
    # A gateway's error page (tens of KB of HTML) became the error's message whole, and with
    # it the audit trail's model.error and run.end entries, the logs and the span status.
    page = "<html>" + "Bad gateway. " * 5000 + "</html>"
    with api_type() as api:
        api.add(Failure(502, page), Failure(400, page))
        async with model_type("m", base_url=api.base_url, api_key="k", max_retries=0) as model:
            for _ in range(2):  # retries exhausted, then a request refused
                with pytest.raises(ModelError, match="Bad gateway") as info:
                    await complete(model, [Message.user("hi")])
                assert len(str(info.value)) < 1200
                assert "more characters" in str(info.value)


@BOTH_PROVIDERS
async def test_a_tool_call_without_a_name_is_a_model_error(
    api_type: type[FakeProviderAPI], model_type: type[SdkModel[Any]], fast: Backoff
) -> None:
    # A call whose name came empty became a call to the tool '': it reached the permission
    # checks and the audit trail as such. Like arguments that are not JSON, it is the answer
    # that is malformed: a ModelError naming the call, not retried.
    with api_type() as api:
        api.add(Reply(tool_calls=[ToolCall(id="call_07", name="", arguments={"city": "Oslo"})]))
        async with model_type("m", base_url=api.base_url, api_key="k", backoff=fast) as model:
            with pytest.raises(ModelError, match=r"tool call call_07 came without a tool name"):
                await complete(model, [Message.user("hi")])
        assert api.request_count == 1


@BOTH_PROVIDERS
@pytest.mark.parametrize("size", [1, 2000], ids=["short", "long"])
async def test_an_error_event_that_is_not_json_says_what_it_held(
    api_type: type[FakeProviderAPI], model_type: type[SdkModel[Any]], fast: Backoff, size: int
) -> None:
    # A proxy's "event: error" with a plain-text body: OpenAI's said only "JSONDecodeError:
    # Expecting value", nothing of what the event held; Anthropic's gave the text whole.
    text = "upstream overloaded, try later" * size
    with api_type() as api:
        api.add(Reply(raw_stream=[f"event: error\ndata: {text}\n\n"]), Reply(text="unused"))
        async with model_type("m", base_url=api.base_url, api_key="k", backoff=fast) as model:
            with pytest.raises(ModelError, match="not JSON: 'upstream overloaded") as info:
                await complete(model, [Message.user("hi")])
        assert api.request_count == 1
    assert len(str(info.value)) < 600


@BOTH_PROVIDERS
async def test_a_server_that_does_not_stream_is_told_apart_from_a_lost_connection(
    api_type: type[FakeProviderAPI], model_type: type[SdkModel[Any]], fast: Backoff
) -> None:
    # A gateway that ignores stream=true answers with the whole JSON body: the call was sent
    # four times (and paid for each time), then failed as a "connection failure".
    with api_type(Reply(text="hello", ignore_stream=True), Reply(text="unused")) as api:
        async with model_type("m", base_url=api.base_url, api_key="k", backoff=fast) as model:
            with pytest.raises(ModelError, match="'application/json' body, not an event stream"):
                await complete(model, [Message.user("hi")])
        assert api.request_count == 1


@BOTH_PROVIDERS
async def test_text_that_is_not_valid_unicode_is_sent_with_replacement_characters(
    api_type: type[FakeProviderAPI], model_type: type[SdkModel[Any]], fast: Backoff
) -> None:
    # A tool's result with a byte that is not UTF-8 (os.listdir names such a file
    # "caf\udce9"): the next model call failed with a bare UnicodeEncodeError from the SDK.
    transcript = [
        Message.user("list the files"),
        Message.assistant("", [ToolCall(id="call_01", name="ls", arguments={})]),
        Message.tool_result("call_01", "caf\udce9.txt", name="ls"),
    ]
    with api_type(Reply(text="done")) as api:
        async with model_type("m", base_url=api.base_url, api_key="k", backoff=fast) as model:
            assert (await complete(model, transcript)).text == "done"
        sent = json.dumps(api.last_request.body, ensure_ascii=False)
    assert "caf\ufffd.txt" in sent
