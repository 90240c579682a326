"""Model adapters: the :class:`Model` protocol, provider adapters and scripted test models.

``resolve_model("claude-opus-4-7")`` builds an :class:`AnthropicModel`,
``resolve_model("gpt-4.1")`` an :class:`OpenAIModel`, and ``resolve_model("scripted")`` an
offline :class:`ScriptedModel`. Importing this package imports neither provider SDK; each is
loaded when its adapter is first built and needs its extra
(``pip install 'loomflow[anthropic]'`` / ``'loomflow[openai]'``).
"""

from __future__ import annotations

from ._resolve import resolve_model
from ._retry import Backoff
from .anthropic import AnthropicModel
from .base import Model, complete
from .openai import OpenAIModel
from .pricing import PRICES, ModelPrice, cost_usd, price_for
from .scripted import (
    FunctionModel,
    ScriptedModel,
    ScriptTurn,
    approx_tokens,
    echo_last_user,
    script_position,
)

__all__ = [
    "AnthropicModel",
    "Backoff",
    "FunctionModel",
    "Model",
    "ModelPrice",
    "OpenAIModel",
    "PRICES",
    "ScriptTurn",
    "ScriptedModel",
    "approx_tokens",
    "complete",
    "cost_usd",
    "echo_last_user",
    "price_for",
    "resolve_model",
    "script_position",
]
