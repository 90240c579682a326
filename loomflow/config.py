"""Deploy-time settings, read from ``LOOMFLOW_*`` environment variables or a ``.env`` file.

This is the only settings class in loomflow; the CLI and the agent take their stores from it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
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
            "Journal value format. `pickle` only to read journals written in the older pickle "
            "format; it runs code from the database on decode."
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
    journal_retention_days: float | None = Field(
        default=None,
        gt=0,
        description=(
            "How long journal entries of finished runs are kept: `loomflow journal prune` "
            "without `--older-than` deletes only entries (and idempotency results) older than "
            "this. Unset, it deletes the entries of every finished run. Keep it longer than "
            "any task can be redelivered: a pruned run resumed later runs its steps again."
        ),
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description=(
            "Base URL of an OTLP/HTTP receiver, e.g. `http://otel-collector:4318`; when set, "
            "`setup_telemetry()` exports spans to `<url>/v1/traces` (needs the `otel` extra)."
        ),
    )
    otlp_headers: str | None = Field(
        default=None,
        description="Extra headers of OTLP export requests, as `name=value,name2=value2`.",
    )
    otel_service_name: str | None = Field(
        default=None,
        description=(
            "`service.name` of exported spans; unset, `OTEL_SERVICE_NAME` or else `loomflow`."
        ),
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description=(
            "When set, `setup_telemetry()` serves Prometheus metrics at `/metrics` on this port "
            "(0 picks a free one)."
        ),
    )
    metrics_host: str = Field(
        default="0.0.0.0",
        description="Address the metrics endpoint binds; `127.0.0.1` keeps it local.",
    )
    telemetry_capture_content: bool = Field(
        default=False,
        description=(
            "Record prompts, completions, tool arguments and tool results on spans. Off by "
            "default: they may hold personal data."
        ),
    )
    audit_url: str | None = Field(
        default=None,
        description=(
            "Where the audit log lives: `memory://`, `sqlite:///relative/path.db`, "
            "`sqlite:////absolute/path.db`, a `postgresql://` DSN, or a JSON-lines file as "
            "`jsonl:///relative/path.jsonl` (or any path ending in `.jsonl`). Unset, it shares "
            "the journal's database (`runtime_url`), so every worker writes one chain per user."
        ),
    )
    redact_secrets: list[SecretStr] = Field(
        default_factory=list,
        description=(
            "Secret values to redact wherever they appear before the audit log (and loomflow's "
            "logs) store them; a JSON list in the environment, e.g. '[\"s3cr3t-db-pass\"]'. "
            "Values shorter than 4 characters are ignored."
        ),
    )
    redact_env: list[str] = Field(
        default_factory=lambda: [
            "ANTHROPIC_API_KEY",
            "OPENAI_API_KEY",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "GITHUB_TOKEN",
        ],
        description=(
            "Names of environment variables whose values are secrets to redact like "
            "`redact_secrets` (read when the redactor is built)."
        ),
    )

    redact_pii: bool = Field(
        default=True,
        description=(
            "Redact personal-data shapes (card numbers passing the Luhn check, e-mail addresses, "
            "IBANs) from audit entries and loomflow's logs. The journal is not affected: mark "
            "tools whose results are personal data `sensitive_result=True` to seal them there."
        ),
    )
    redact_patterns: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "More personal-data shapes to redact like `redact_pii`, as a JSON object of kind to "
            'regular expression, e.g. \'{"customer_id": "CUST-[0-9]{8}"}\'; a match becomes '
            "`[REDACTED:<kind>]`."
        ),
    )

    @property
    def audit_store_url(self) -> str:
        """``audit_url``, or the journal's ``runtime_url`` when it is unset."""
        return self.audit_url or self.runtime_url

    budget_url: str | None = Field(
        default=None,
        description=(
            "Where budget totals live (`memory://`, a `sqlite:///` path or a `postgresql://` "
            "DSN). Unset, the budget shares the journal's database (`runtime_url`)."
        ),
    )
