"""MkDocs hook: the settings page is generated from the Settings class at build time."""

from __future__ import annotations

from typing import Any

from loomflow._settings_doc import settings_markdown

MARKER = "<!-- settings-table -->"


def on_page_markdown(markdown: str, **_: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, settings_markdown())
    return markdown
