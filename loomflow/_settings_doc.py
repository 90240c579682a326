"""Render :class:`loomflow.config.Settings` as a Markdown table (for the docs' settings page)."""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import PydanticUndefined

from .config import Settings

__all__ = ["settings_markdown"]


def _default(value: Any) -> str:
    if value is PydanticUndefined:
        return "(required)"
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


def settings_markdown(settings_cls: type[Settings] = Settings) -> str:
    """One row per setting: the environment variable, its default and its description."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    rows = ["| environment variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in settings_cls.model_fields.items():
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{prefix}{name.upper()}` | {_default(field.default)} | {description} |")
    return "\n".join(rows) + "\n"
