"""resolve_model and the lazy, optional provider SDK imports."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from loomflow.errors import ConfigurationError, UserError
from loomflow.messages import Message
from loomflow.models import (
    AnthropicModel,
    Model,
    OpenAIModel,
    ScriptedModel,
    complete,
    resolve_model,
)


@pytest.fixture(autouse=True)
def _keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # Building a client needs credentials; no request is sent in these tests.
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")


@pytest.mark.parametrize(
    ("spec", "cls", "name"),
    [
        ("claude-opus-4-7", AnthropicModel, "claude-opus-4-7"),
        ("anthropic:claude-haiku-4-5", AnthropicModel, "claude-haiku-4-5"),
        ("gpt-4.1", OpenAIModel, "gpt-4.1"),
        ("o3", OpenAIModel, "o3"),
        ("o4-mini", OpenAIModel, "o4-mini"),
        ("o1-preview", OpenAIModel, "o1-preview"),
        ("openai:my-finetune", OpenAIModel, "my-finetune"),
    ],
)
async def test_provider_specs(spec: str, cls: type, name: str) -> None:
    model = resolve_model(spec)
    assert isinstance(model, cls)
    assert model.name == name
    await model.aclose()  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec", ["scripted", "test"])
async def test_scripted_specs_answer_offline(spec: str) -> None:
    model = resolve_model(spec)
    assert isinstance(model, ScriptedModel)
    assert model.provider == "scripted"
    for _ in range(3):  # never runs out
        response = await complete(model, [Message.user("ping")])
    assert response.text == "Echo: ping"


def test_a_model_object_passes_through() -> None:
    model = ScriptedModel(["x"])
    assert resolve_model(model) is model
    assert isinstance(model, Model)


@pytest.mark.parametrize("spec", ["llama-3", "mistral:large", "anthropic:", "", "  "])
def test_unknown_specs_are_a_user_error(spec: str) -> None:
    with pytest.raises(UserError, match="model"):
        resolve_model(spec)


def test_a_non_model_object_is_a_user_error() -> None:
    with pytest.raises(UserError, match="int"):
        resolve_model(42)  # type: ignore[arg-type]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_importing_loomflow_models_imports_no_provider_sdk() -> None:
    result = _run(
        """
        import sys
        import loomflow.models
        from loomflow.models import resolve_model
        resolve_model("scripted")
        print(sorted(m for m in ("anthropic", "openai") if m in sys.modules))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("sdk", "spec", "extra"),
    [("anthropic", "claude-opus-4-7", "anthropic"), ("openai", "gpt-4.1", "openai")],
)
def test_a_missing_sdk_says_what_to_install(sdk: str, spec: str, extra: str) -> None:
    # A None entry in sys.modules makes ``import <sdk>`` fail as if it were not installed.
    result = _run(
        f"""
        import sys
        sys.modules[{sdk!r}] = None
        from loomflow.models import resolve_model
        try:
            resolve_model({spec!r})
        except ImportError as exc:
            print(exc)
        """
    )
    assert result.returncode == 0, result.stderr
    assert f"pip install 'loomflow[{extra}]'" in result.stdout


def test_missing_openai_credentials_are_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(ConfigurationError, match="OPENAI_API_KEY"):
        resolve_model("gpt-4.1")


def test_missing_anthropic_credentials_are_a_configuration_error_when_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The SDK itself would only fail at the first request, with a TypeError.
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    with pytest.raises(ConfigurationError, match="ANTHROPIC_API_KEY"):
        resolve_model("anthropic:claude-sonnet-4-5")


_SECRET = "sk-abcdef0123456789"


@pytest.mark.parametrize("spec", ["gpt-4.1", "claude-sonnet-4-5"])
@pytest.mark.parametrize(
    ("key", "named"),
    [
        (_SECRET + "\n", "white space or a control character"),  # a key read from a file
        (" " + _SECRET, "white space or a control character"),
        (_SECRET + "\u2019", "not ASCII"),  # a quote pasted along with it
    ],
)
def test_an_api_key_no_request_can_carry_is_a_configuration_error_when_built(
    monkeypatch: pytest.MonkeyPatch, spec: str, key: str, named: str
) -> None:
    # Sent as it was, each call failed as a "connection failure" retried to exhaustion (the
    # HTTP library refuses the header), or with a bare UnicodeEncodeError.
    variable = "OPENAI_API_KEY" if spec.startswith("gpt") else "ANTHROPIC_API_KEY"
    monkeypatch.setenv(variable, key)
    with pytest.raises(ConfigurationError, match=named) as info:
        resolve_model(spec)
    assert variable in str(info.value)
    assert _SECRET not in str(info.value)


def test_an_empty_anthropic_key_is_no_credential() -> None:
    from loomflow.models import AnthropicModel

    with pytest.raises(ConfigurationError, match="ANTHROPIC_API_KEY"):
        AnthropicModel("claude-sonnet-4-5", base_url="http://127.0.0.1:9", api_key="")


@pytest.mark.parametrize("spec", ["gpt-4.1", "claude-sonnet-4-5"])
@pytest.mark.parametrize(
    "url", ["localhost:8000/v1", "127.0.0.1:8000", "htp://proxy:8000", "http://user:pw-secret@/v1"]
)
def test_a_base_url_that_is_no_http_url_is_a_configuration_error_when_built(
    monkeypatch: pytest.MonkeyPatch, spec: str, url: str
) -> None:
    # Every call failed as a "connection failure" (an unsupported protocol), retried to
    # exhaustion, and the error metric counted lost connections.
    variable = "OPENAI_BASE_URL" if spec.startswith("gpt") else "ANTHROPIC_BASE_URL"
    monkeypatch.setenv(variable, url)
    monkeypatch.setenv(variable.replace("BASE_URL", "API_KEY"), "sk-test")
    with pytest.raises(ConfigurationError, match=r"http\(s\) URL") as info:
        resolve_model(spec)
    assert variable in str(info.value)
    assert "pw-secret" not in str(info.value)
