"""Deploy-time settings, read from ``LOOMFLOW_*`` environment variables or a ``.env`` file.

This is the only settings class in loomflow; the CLI and the agent take their stores from it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]


class Settings(BaseSettings):
    """Everything an operator may set without touching code."""

    model_config = SettingsConfigDict(
        env_prefix="LOOMFLOW_", env_file=".env", env_file_encoding="utf-8", extra="ignore"
    )

    runtime_url: str = Field(
        default="sqlite:///.loomflow/journal.db",
        description=(
            "Where the journal lives: `memory://`, `sqlite:///relative/path.db`, "
            "`sqlite:////absolute/path.db` or a `postgresql://` DSN."
        ),
    )
    serializer: Literal["json", "pickle"] = Field(
        default="json",
        description=(
            "Journal value format. `pickle` only to read entries written by loomflow 0.16 or "
            "older; it runs code from the database on decode."
        ),
    )
    max_payload_bytes: int = Field(
        default=8 * 1024 * 1024,
        gt=0,
        description="Largest encoded step result the journal accepts.",
    )
    strict_replay: bool = Field(
        default=False,
        description="Raise instead of running fresh when a replayed step's inputs changed.",
    )
    turn_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description=(
            "How long a run waits for another run on the same (session, user) to finish "
            "before failing with SessionBusyError."
        ),
    )
    lease_seconds: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Ownership lease of a (session, user) turn, renewed while the run is alive. "
            "A crashed worker's turn is free after this long (at once if it ran on this host)."
        ),
    )
    sqlite_busy_timeout_ms: int = Field(
        default=5000, ge=0, description="SQLite busy_timeout for contended writes."
    )
    sqlite_synchronous: Literal["FULL", "NORMAL", "EXTRA"] = Field(
        default="FULL",
        description="SQLite synchronous pragma; FULL survives power loss in WAL mode.",
    )
    auto_migrate: bool = Field(
        default=True,
        description="Apply pending schema migrations when a runtime first connects.",
    )
