"""Redaction of secrets and sensitive arguments, log scrubbing, and sealing for the journal."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from loomflow.audit import Redactor, install_log_redaction
from loomflow.audit.redaction import PLACEHOLDER
from loomflow.audit.sealing import SEALED_ERROR, SealedValueLost, Sealer
from loomflow.config import Settings
from loomflow.messages import ModelResponse, TextDelta, ToolCall, ToolCallDelta
from loomflow.tools import ToolOutcome, tool

SHAPES = {
    "api_key": "sk-ant-api03-abcdefghijklmnopqrstuvwxyz012345",
    "aws_access_key": "AKIAIOSFODNN7EXAMPLE",
    "google_api_key": "AIzaSyA-1234567890abcdefghijklmnopqrstu",
    "github_token": "ghp_" + "a1B2" * 9,
    "slack_token": "xoxb-1234567890-abcdefghij",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
    "bearer_token": "Bearer abc.def-ghi_jkl~mno",
    "private_key": "-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----",
}


@pytest.mark.parametrize(("kind", "secret"), SHAPES.items())
def test_secret_shapes_are_found_inside_any_text(kind: str, secret: str) -> None:
    out = Redactor().text(f"before {secret} after")
    assert secret not in out
    assert out == f"before [REDACTED:{kind}] after"


def test_ordinary_text_is_left_alone() -> None:
    text = 'the task-runner sk-8 uses AKIA keys; bearer of news; eyJ is base64 for {"'
    assert Redactor().text(text) == text


def test_configured_and_environment_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_DB_PASSWORD", "pa55-w0rd-db")
    monkeypatch.setenv("LOOMFLOW_REDACT_SECRETS", '["hunter22", "abc"]')
    monkeypatch.setenv("LOOMFLOW_REDACT_ENV", '["MY_DB_PASSWORD"]')
    redactor = Redactor.from_settings(Settings())
    assert redactor.text("hunter22 / pa55-w0rd-db / abc") == "[REDACTED] / [REDACTED] / abc"
    assert "hunter22" not in repr(Settings())  # settings never print the secret either


def test_values_nested_keys_and_long_text() -> None:
    redactor = Redactor(secrets=["s3cret-value"])
    value = {
        "headers": {"Authorization": "Basic xyz", "X-Api-Key": "k", "accept": "json"},
        "items": ["ok", "has s3cret-value inside", 3, None, 1.5],
        "long": "x" * 50,
        "token_count": 12,
    }
    out = redactor.value(value, max_text=10)
    assert out["headers"] == {"Authorization": PLACEHOLDER, "X-Api-Key": PLACEHOLDER,
                              "accept": "json"}  # fmt: skip
    assert out["items"] == ["ok", "has [REDAC…[+11 chars]", 3, None, 1.5]
    assert out["long"] == "xxxxxxxxxx…[+40 chars]"
    assert out["token_count"] == 12


def test_arguments_hide_declared_names_and_everything_of_unknown_tools() -> None:
    redactor = Redactor()
    args = {"card": "4111", "amount": 5, "password": "p", "memo": "sk-abcdefghijklmnopqrstuvw"}
    assert redactor.arguments(args, frozenset({"card"})) == {
        "card": PLACEHOLDER,
        "amount": 5,
        "password": PLACEHOLDER,
        "memo": "[REDACTED:api_key]",
    }
    assert set(redactor.arguments(args, None).values()) == {PLACEHOLDER}


def test_argument_names_are_redacted_as_object_keys_are() -> None:
    # A tool the model made up has no schema, so its argument names are the model's text: a
    # key or an e-mail address as a name showed in clear, while the same name one level
    # down was redacted.
    redactor = Redactor()
    key = "sk-abcdefghijklmnopqrstuvwxyz0123"
    args = {key: "v", "ana@example.com": 1, "bob@example.com": 2, "nested": {key: 3}}
    assert redactor.arguments(args, None) == {
        "[REDACTED:api_key]": PLACEHOLDER,
        "[REDACTED:email]": PLACEHOLDER,
        "[REDACTED:email]#2": PLACEHOLDER,
        "nested": PLACEHOLDER,
    }
    assert redactor.arguments(args, frozenset()) == {
        "[REDACTED:api_key]": "v",
        "[REDACTED:email]": 1,
        "[REDACTED:email]#2": 2,
        "nested": {"[REDACTED:api_key]": 3},
    }


# Keys whose values hide, by the words in them; before, only a whole key of the list did
# (db_password, github_token and a header map's X-Api-Key showed their values).
HIDDEN_KEYS = [
    "password", "db_password", "dbPassword", "user_password", "newPassword", "password2",
    "password_hash", "password_confirmation", "passwd", "passphrase", "smtp_pass", "pass",
    "db_pwd", "secret", "stripe_secret", "clientSecret", "secret_key", "aws_secret_access_key",
    "AWS_SECRET_ACCESS_KEY", "aws.secret_access_key", "token", "github_token", "githubToken",
    "slackBotToken", "id_token", "csrf_token", "OAuthToken", "access_tokens", "api_key",
    "apiKey", "APIKey", "APIKEY", "X-Api-Key", "x_api_key", "XAPIKey", "google_api_key",
    "aws_access_key", "private_key", "privateKey", "signing_key", "cookie", "Cookie",
    "Set-Cookie", "session_cookie", "cookies", "authorization", "Proxy-Authorization",
    "HTTP_AUTHORIZATION", "authorization_code", "credential", "credentials", "jwt",
]  # fmt: skip
# Keys that merely hold such letters, or that describe a secret without holding it: the
# usage fields loomflow writes (model.call, run.end, budgets, spans) among them.
VISIBLE_KEYS = [
    "token_count", "tokenCount", "max_tokens", "tokens_used", "input_tokens", "output_tokens",
    "prompt_tokens", "completion_tokens", "total_tokens", "cache_read_tokens",
    "cache_write_tokens", "cached_tokens", "max_completion_tokens", "prompt_tokens_details",
    "tokens_in", "tokens_out", "tokens_total", "tokens", "token_usage", "token_limit",
    "token_budget", "token_type", "cost_per_token", "input_cost_per_token", "eos_token",
    "next_token", "page_token", "tokenizer", "secretary", "passage", "passenger", "passport",
    "bypass", "compass", "pwd", "secret_name", "api_key_id", "aws_access_key_id",
    "private_key_path", "credentials_file", "authorization_url", "password_policy",
    "password_min_length", "cookie_consent", "cookie_domain", "key", "user_key",
    "idempotency_key", "monkey", "keyboard",
    "bearer",  # the console counts failed sign-ins by way in; a bearer token is a shape anyway
]  # fmt: skip


@pytest.mark.parametrize("key", HIDDEN_KEYS)
def test_a_key_whose_words_name_a_secret_hides_its_value(key: str) -> None:
    redactor = Redactor()
    assert redactor.value({key: "v4lue", "nested": {key: 7}}) == {
        key: PLACEHOLDER,
        "nested": {key: PLACEHOLDER},
    }
    assert redactor.arguments({key: "v4lue"}, frozenset()) == {key: PLACEHOLDER}


@pytest.mark.parametrize("key", VISIBLE_KEYS)
def test_a_key_that_only_holds_the_letters_of_a_secret_word_stays_visible(key: str) -> None:
    redactor = Redactor()
    assert redactor.value({key: 12, "nested": {key: "text"}}) == {key: 12, "nested": {key: "text"}}
    assert redactor.arguments({key: 12}, frozenset()) == {key: 12}


def test_key_words_can_be_turned_off_and_each_key_is_judged_once() -> None:
    exact = Redactor(key_words=False)
    assert exact.value({"db_password": "p", "password": "p"}) == {
        "db_password": "p",
        "password": PLACEHOLDER,
    }
    redactor = Redactor()
    for _ in range(3):
        redactor.value({"db_password": "p", "max_tokens": 5})
    assert redactor._hiding == {"db_password": True, "max_tokens": False}
    redactor.learn("sekret-value")  # a learned value changes what keys read, not what hides
    assert redactor._hiding == {"db_password": True, "max_tokens": False}


def test_learned_values_are_redacted_and_bounded() -> None:
    redactor = Redactor(max_learned=2)
    redactor.learn({"a": "value-one", "b": ["value-two", 12345, True, None, "xy"]})
    assert redactor.text("value-one value-two 12345 xy") == "value-one [REDACTED] [REDACTED] xy"
    redactor.learn("value-one")
    assert redactor.text("value-one 12345") == "[REDACTED] [REDACTED]"
    assert redactor.text("value-two") == "value-two"  # the oldest was forgotten


def test_log_records_of_loomflow_and_drivers_are_scrubbed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    redactor = Redactor(secrets=["t0p-secret-log"])
    install_log_redaction(redactor)
    install_log_redaction(redactor)  # idempotent
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("loomflow.tools").debug("args %s", {"x": "t0p-secret-log"})
        logging.getLogger("aiosqlite").debug("executing %r", ("t0p-secret-log",))
        try:
            raise ValueError("failed with t0p-secret-log")
        except ValueError:
            logging.getLogger("loomflow.agent").exception("boom")
        logging.getLogger("myapp").debug("mine: t0p-secret-log")
    assert caplog.records[0].getMessage() == "args {'x': '[REDACTED]'}"
    assert "t0p-secret-log" not in caplog.records[1].getMessage()
    assert "failed with [REDACTED]" in caplog.text
    assert "Traceback" in caplog.text
    assert caplog.records[2].exc_info is None  # the exception object is dropped
    assert caplog.records[3].getMessage() == "mine: t0p-secret-log"  # not ours to touch


# -- sealing --------------------------------------------------------------------------------


@tool(sensitive=("card",))
def pay(card: str, amount: int) -> str:
    """Pay."""
    return "ok"


def _sealer() -> Sealer:
    return Sealer({"pay": pay}, Redactor(secrets=["conf-secret-1"]))


def test_sealing_replaces_sensitive_and_secret_arguments_and_unsealing_restores_them() -> None:
    sealer = _sealer()
    call = ToolCall(
        id="1", name="pay", arguments={"card": "4111-2222", "amount": 5, "note": "conf-secret-1"}
    )
    sealed = sealer.seal_call(call)
    assert sealed.arguments["amount"] == 5
    assert sealed.arguments["card"].startswith("[sealed:")
    assert sealed.arguments["note"].startswith("[sealed:")
    assert "4111-2222" not in sealed.model_dump_json()
    assert sealer.seal_call(sealed) == sealed  # a replayed (already sealed) call stays as is
    assert sealer.unseal(sealed) == call
    plain = ToolCall(id="2", name="other", arguments={"q": "weather"})
    assert sealer.seal_call(plain) is plain
    assert sealer.unseal(plain) is plain


def test_a_sealed_value_lost_in_a_restart_becomes_a_tool_error() -> None:
    sealed = _sealer().seal_call(ToolCall(id="1", name="pay", arguments={"card": "4111-2222"}))
    fresh = _sealer()  # another process: empty vault
    with pytest.raises(SealedValueLost, match="call the tool again") as info:
        fresh.unseal(sealed)
    outcome = fresh.lost(info.value)
    assert (outcome.ok, outcome.error_type) == (False, SEALED_ERROR)


def test_scrub_removes_sealed_values_from_results_only_when_present() -> None:
    sealer = _sealer()
    sealer.seal_call(ToolCall(id="1", name="pay", arguments={"card": "4111-2222"}))
    echo = ToolOutcome(ok=True, value={"paid_with": "4111-2222", "n": (1, 2)})
    assert sealer.scrub(echo).value == {"paid_with": PLACEHOLDER, "n": [1, 2]}
    clean = ToolOutcome(ok=True, value={"n": (1, 2)})
    assert sealer.scrub(clean) is clean  # untouched results keep their exact value
    failed = ToolOutcome(ok=False, error="card 4111-2222 declined", error_type="tool_error")
    assert sealer.scrub(failed).error == f"card {PLACEHOLDER} declined"


def _shown(chunks: list[Any]) -> str:
    """The chunks as JSON without the sealed placeholders, whose random HMAC hex can hold
    any four digits by chance."""
    text = "".join(c.model_dump_json() for c in chunks)
    return re.sub(r"\[sealed:[0-9a-f]{20}\]", "[sealed]", text)


@pytest.mark.parametrize("with_response", [True, False])
async def test_deltas_that_name_no_call_of_the_response_are_not_shown(with_response: bool) -> None:
    # A model numbering its only call 1 (or a stream that brings no response): the deltas
    # cannot be matched to a call whose arguments were checked, so they were shown raw.
    response = ModelResponse(
        tool_calls=[ToolCall(id="a", name="pay", arguments={"card": "4111-2222", "amount": 1})],
        finish_reason="tool_calls",
    )

    async def stream() -> AsyncIterator[Any]:
        yield ToolCallDelta(index=1, id="a", name="pay", arguments_delta='{"card": "4111-2222"')
        yield ToolCallDelta(index=1, arguments_delta=', "amount": 1}')
        if with_response:
            yield response

    chunks = [c async for c in _sealer().stream(stream())]
    assert "4111" not in _shown(chunks)
    assert len(chunks) == (1 if with_response else 0)


async def test_the_stream_holds_sealed_call_deltas_and_passes_the_rest() -> None:
    response = ModelResponse(
        text="hi",
        tool_calls=[
            ToolCall(id="a", name="pay", arguments={"card": "4111-2222", "amount": 1}),
            ToolCall(id="b", name="other", arguments={"q": 1}),
        ],
        finish_reason="tool_calls",
    )

    async def stream() -> AsyncIterator[Any]:
        yield TextDelta(text="hi")
        yield ToolCallDelta(index=0, id="a", name="pay", arguments_delta='{"card": "4111')
        yield ToolCallDelta(index=0, arguments_delta='-2222", "amount": 1}')
        yield ToolCallDelta(index=1, id="b", name="other", arguments_delta='{"q": 1}')
        yield response

    chunks = [c async for c in _sealer().stream(stream())]
    assert chunks[0] == TextDelta(text="hi")
    assert "4111" not in _shown(chunks)
    sealed_delta, other_delta, final = chunks[1:]
    assert sealed_delta.index == 0
    assert sealed_delta.arguments_delta.startswith('{"amount":1,"card":"[sealed:')
    assert other_delta == ToolCallDelta(index=1, id="b", name="other", arguments_delta='{"q": 1}')
    assert isinstance(final, ModelResponse)
    assert final.tool_calls[1] is response.tool_calls[1]
