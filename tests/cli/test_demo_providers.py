"""``loomflow demo --model``: the demo story driven by a provider's real SDK.

The provider is a local server speaking its wire format (``loomflow.testing.providers``); the
CLI runs as a subprocess and finds it through the SDK's own ``*_BASE_URL`` variable, as it
would find the real API with a key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loomflow.cli._demo_task import FINAL, PLAN
from loomflow.messages import ToolCall
from loomflow.testing.providers import FakeAnthropicAPI, FakeOpenAIAPI, FakeProviderAPI, Reply

PROVIDERS = {
    "anthropic": (FakeAnthropicAPI, "anthropic:claude-sonnet-4-5", "ANTHROPIC"),
    "openai": (FakeOpenAIAPI, "openai:gpt-5-mini", "OPENAI"),
}


def _turn(turn: int, calls: list[tuple[str, dict[str, object]]]) -> Reply:
    return Reply(
        tool_calls=[
            ToolCall(id=f"call_{turn}_{i}", name=name, arguments=args)
            for i, (name, args) in enumerate(calls)
        ],
        input_tokens=900,
        output_tokens=40,
    )


def _demo(
    api: FakeProviderAPI | None, env_prefix: str, *args: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    if api is not None:
        env[f"{env_prefix}_BASE_URL"] = api.base_url
        env[f"{env_prefix}_API_KEY"] = "sk-local-test"
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _ledger(workdir: Path) -> list[dict[str, object]]:
    (ledger,) = workdir.glob("loomflow-demo-*-side-effects.jsonl")
    lines = ledger.read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_demo_with_a_provider_model_kills_resumes_and_calls_the_api_once_per_turn(
    provider: str, tmp_path: Path
) -> None:
    fake, spec, env_prefix = PROVIDERS[provider]
    replies = [_turn(t, calls) for t, calls in enumerate(PLAN)] + [Reply(text=FINAL)]
    with fake(*replies) as api:
        result = _demo(
            api, env_prefix, "--model", spec, "--kill-after", "2", "--workdir", str(tmp_path)
        )
        requests = api.request_count
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"{provider} model {spec.split(':')[1]}" in out
    assert "killed with SIGKILL" in out
    # Two turns came from the killed worker and replay; the other three reach the API once.
    assert requests == len(PLAN) + 1
    assert "hits=5 misses=6 divergences=0" in out  # the last miss: the run's episode
    assert "reserved by the killed worker for the call it was starting" in out
    assert "No side effect ran twice" in out
    ledger = _ledger(tmp_path)
    assert sorted(r["action"] for r in ledger) == sorted(n for turn in PLAN for n, _ in turn)
    assert len({r["pid"] for r in ledger}) == 2


def test_a_model_that_repeats_a_call_on_purpose_is_not_a_repeated_side_effect(
    tmp_path: Path,
) -> None:
    # The model looks the order up twice (two calls, two effects); the kill falls between them.
    lookup = ("lookup_order", {"order_id": "A-1042"})
    replies = [_turn(0, [lookup]), _turn(1, [lookup]), Reply(text="Order A-1042 exists.")]
    with FakeAnthropicAPI(*replies) as api:
        result = _demo(
            api,
            "ANTHROPIC",
            "--model",
            "anthropic:claude-sonnet-4-5",
            "--kill-after",
            "1",
            "--workdir",
            str(tmp_path),
        )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "each of the 2 tool calls the model made happened exactly once" in result.stdout
    assert [r["action"] for r in _ledger(tmp_path)] == ["lookup_order", "lookup_order"]


def test_a_model_that_finishes_before_the_kill_point_still_resumes_by_replay(
    tmp_path: Path,
) -> None:
    replies = [_turn(0, [PLAN[0][0]]), Reply(text="Nothing more to do.")]
    with FakeOpenAIAPI(*replies) as api:
        result = _demo(
            api, "OPENAI", "--model", "gpt-5-mini", "--kill-after", "3", "--workdir", str(tmp_path)
        )
        requests = api.request_count
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exited before the kill point" in result.stdout
    assert "ran fresh" not in result.stdout  # the finished run replays whole
    assert requests == 2
    assert len(_ledger(tmp_path)) == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("anthropic:claude-sonnet-4-5", "ANTHROPIC_API_KEY"),
        ("openai:gpt-5-mini", "OPENAI_API_KEY"),
        ("scripted", "is a scripted model"),
        ("mistral-large", "cannot tell which provider"),
        ("ollama:llama3", "unknown model provider 'ollama'"),
        ("", "--model needs a model id"),
    ],
)
def test_a_model_that_cannot_run_fails_before_any_worker_starts(
    spec: str, message: str, tmp_path: Path
) -> None:
    workdir = tmp_path / "demo"
    result = _demo(None, "", "--model", spec, "--workdir", str(workdir))
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    # The forms the demo refuses (a scripted model, a Model object) are not offered to it.
    assert "'scripted' or 'test'" not in result.stderr
    assert "Model object" not in result.stderr
    assert not workdir.exists()  # nothing was started or left behind


def test_arguments_the_tool_normalises_and_calls_it_refuses_are_not_miscounted(
    tmp_path: Path,
) -> None:
    # Real models send "2" for 2 and 60 for 59.8, and sometimes arguments a tool rejects; the
    # proof compares completed calls per tool with the ledger, so neither looks like a repeat.
    replies = [
        _turn(0, [("lookup_order", {"order_id": "A-1042"})]),
        _turn(1, [("reserve_stock", {"sku": "LOOM-7", "quantity": "lots"})]),  # rejected
        _turn(2, [("reserve_stock", {"sku": "LOOM-7", "quantity": "2"})]),
        _turn(3, [("charge_card", {"order_id": "A-1042", "amount_usd": 60})]),
        Reply(text="Reserved and charged."),
    ]
    with FakeOpenAIAPI(*replies) as api:
        result = _demo(
            api, "OPENAI", "--model", "gpt-5-mini", "--kill-after", "3", "--workdir", str(tmp_path)
        )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "each of the 3 tool calls the model made happened exactly once" in result.stdout
    ledger = _ledger(tmp_path)
    assert [r["action"] for r in ledger] == ["lookup_order", "reserve_stock", "charge_card"]
    assert ledger[1]["args"] == {"sku": "LOOM-7", "quantity": 2}
