"""Turn a model spec string into a :class:`~loomflow.models.base.Model`."""

from __future__ import annotations

from ..errors import UserError
from .base import Model
from .scripted import ScriptedModel, echo_last_user

__all__ = ["resolve_model"]

_OPENAI_PREFIXES = ("gpt-", "chatgpt-", "o1", "o3", "o4")
SCRIPTED_SPECS = ("scripted", "test")

PROVIDER_FORMS = (
    "'claude-…' or 'anthropic:<model>' (Anthropic), 'gpt-…', 'o1…', 'o3…', 'o4…' or "
    "'openai:<model>' (OpenAI)"
)
_FORMS = f"{PROVIDER_FORMS}, 'scripted' or 'test' (offline), or a Model object"


def resolve_model(spec: str | Model) -> Model:
    """Return ``spec`` if it is a model, else build the model a spec string names.

    Provider SDKs are imported only for the provider named, so an app using one provider never
    imports the other.

    Example:
        >>> resolve_model("scripted").provider
        'scripted'
    """
    if not isinstance(spec, str):
        if isinstance(spec, Model):
            return spec
        raise UserError(f"model must be a Model or a string, got {type(spec).__name__}")
    lowered = spec.strip().lower()
    if lowered in SCRIPTED_SPECS:
        return ScriptedModel(name=lowered, default=echo_last_user)
    return provider_model(spec, forms=_FORMS)


def provider_model(spec: str, *, forms: str = PROVIDER_FORMS) -> Model:
    """Build the provider's model a spec string names: no scripted model, no Model object.

    ``forms`` is what an error offers instead, so a caller that takes more (as
    :func:`resolve_model` does) names it, and one that takes less (``loomflow demo --model``)
    does not offer what it would refuse.
    """
    text = spec.strip()
    provider, sep, model = text.partition(":")
    if sep:
        provider = provider.lower()
        if not model:
            raise UserError(f"model spec {spec!r} names no model after {provider + ':'!r}")
        if provider == "anthropic":
            return _anthropic(model)
        if provider == "openai":
            return _openai(model)
        raise UserError(f"unknown model provider {provider!r} in {spec!r}; use {forms}")
    lowered = text.lower()
    if lowered.startswith("claude"):
        return _anthropic(text)
    if lowered.startswith(_OPENAI_PREFIXES):
        return _openai(text)
    raise UserError(f"cannot tell which provider serves model {spec!r}; use {forms}")


def _anthropic(model: str) -> Model:
    from .anthropic import AnthropicModel

    return AnthropicModel(model)


def _openai(model: str) -> Model:
    from .openai import OpenAIModel

    return OpenAIModel(model)
