"""The settings page lists every setting with its variable and description."""

from __future__ import annotations

from loomflow._settings_doc import settings_markdown
from loomflow.config import Settings


def test_every_setting_has_a_row_and_a_description() -> None:
    table = settings_markdown()
    for name, field in Settings.model_fields.items():
        assert f"`LOOMFLOW_{name.upper()}`" in table
        assert field.description, f"{name} needs a description for the docs"
    assert "`sqlite:///.loomflow/journal.db`" in table
