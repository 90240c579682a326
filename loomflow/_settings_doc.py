"""Render :class:`loomflow.config.Settings` as a Markdown table (for the docs' settings page)."""

from __future__ import annotations

import json

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .config import Settings

__all__ = ["settings_markdown"]


def _default(field: FieldInfo) -> str:
    # A list default comes from a factory (``field.default`` is then undefined), not a
    # requirement: only a field with neither is required.
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, list) and not value:
        return "(none)"
    if isinstance(value, list):
        shown = [v.get_secret_value() if isinstance(v, SecretStr) else v for v in value]
        return f"`{','.join(str(v) for v in shown)}`"
    return f"`{json.dumps(value)}`"


def settings_markdown(settings_cls: type[Settings] = Settings) -> str:
    """One row per setting: the environment variable, its default and its description."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    rows = ["| environment variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in settings_cls.model_fields.items():
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{prefix}{name.upper()}` | {_default(field)} | {description} |")
    return "\n".join(rows) + "\n"
