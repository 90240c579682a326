"""Deploy-time settings, read from ``LOOMFLOW_*`` environment variables or a ``.env`` file.

This is the only settings class in loomflow; the CLI and the agent take their stores from it.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from dotenv.parser import parse_stream
from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from ._timefmt import MAX_AGE
from .errors import ConfigurationError

_log = logging.getLogger("loomflow.config")

__all__ = [
    "MAX_BUSY_TIMEOUT_MS",
    "Settings",
    "lower_scheme",
    "scheme_without_slashes",
    "sqlite_path",
]

# The largest SQLite busy timeout: SQLite reads it into a C int, and a value beyond one is
# taken as 0 (fail at once on a lock) without a word.
MAX_BUSY_TIMEOUT_MS = 2**31 - 1

# Settings that are URLs and may carry a password (``postgresql://app:pw@db/app``): the code
# reads the real value, while repr/str, model_dump and `loomflow settings` show it masked.
_URL_SETTINGS = ("runtime_url", "audit_url", "budget_url", "otlp_endpoint")
# Up to the *last* "@": a password with an unescaped "@", "/", "?" or "#" is still hidden
# whole (masking a little too much is harmless; showing part of a password is not).
_USERINFO_PASSWORD = re.compile(r"(://[^:/@?#]*:).*@", re.DOTALL)
# sslpassword: the passphrase of the client certificate's key (libpq, asyncpg).
_QUERY_PASSWORD = re.compile(r"([?&](?:password|passwd|pwd|sslpassword)=)[^&#]*", re.IGNORECASE)


def _masked_url(url: str) -> str:
    """``url`` with its password (user-info or ``?password=``) replaced by ``***``."""
    return _QUERY_PASSWORD.sub(r"\1***", _USERINFO_PASSWORD.sub(r"\1***@", url))


def check_otlp_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host and a valid port (``ValueError`` if not)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{_masked_url(url)!r} is not an http(s) URL like http://otel-collector:4318"
        )
    try:
        _ = parts.port  # parsed on access: one that is no number, or above 65535, raises
    except ValueError:
        # Otherwise found only by the exporter's thread, which then drops every span.
        raise ValueError(f"bad port in {_masked_url(url)!r}") from None
    return url


def check_otlp_headers(text: str) -> None:
    """Raise ``ValueError`` unless ``text`` is ``name=value`` items separated by commas."""
    for i, item in enumerate(text.split(","), start=1):
        name, equals, _ = item.partition("=")
        if item.strip() and not (equals and name.strip()):
            # The item itself is not shown: it usually carries a token.
            raise ValueError(f"item {i} is not name=value (the value is kept secret)")


def _text_list(value: Any) -> Any:
    """A list from the environment: a JSON list, or comma-separated values (blanks dropped)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not a JSON list ({exc}); or give comma-separated values") from None
    return [item.strip() for item in text.split(",") if item.strip()]


_PATTERNS_FORM = (
    'a JSON object of kind to regular expression, e.g. {"customer_id": "CUST-[0-9]{8}"}'
)


def _json_object(value: Any) -> Any:
    """A mapping from the environment: a JSON object (blank: none), read here rather than by
    pydantic-settings, whose failure names neither the variable nor the form it takes."""
    if not isinstance(value, str):
        return value
    if not value.strip():
        return {}
    try:
        found = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc}): give {_PATTERNS_FORM}") from None
    if not isinstance(found, dict):
        raise ValueError(f"a JSON {type(found).__name__}, not {_PATTERNS_FORM}")
    return found


# "sqlite:journal.db" or "postgres:db-host/app" has no "//", so it would read as a bare file
# path: a SQLite file of that odd name in the working directory, while whoever wrote it
# believes the journal is somewhere else (a PostgreSQL server, say).
_SCHEME_WITHOUT_SLASHES = re.compile(r"(sqlite|jsonl|postgres|postgresql):(?!//)", re.IGNORECASE)


def scheme_without_slashes(url: str) -> str | None:
    """Why ``url``, which holds no ``://``, is not a file path but a store URL missing its
    ``//`` (``sqlite:journal.db``); ``None`` when it may be a path."""
    found = _SCHEME_WITHOUT_SLASHES.match(url)
    if found is None:
        return None
    scheme = found.group(1).lower()
    if scheme.startswith("postgres"):  # the rest may hold a password no mask recognises
        return (
            f"a URL starting {found.group(0)!r} lacks the '//' after its scheme and would be "
            "taken for a file path: use postgresql://user@host:5432/database"
        )
    return (
        f"{url!r} lacks the '//' after its scheme and would be taken for a file path: use "
        f"{scheme}:///relative/path or {scheme}:////absolute/path"
    )


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def lower_scheme(url: str) -> str:
    """``url`` with its scheme in lower case (``SQLITE:///x.db`` -> ``sqlite:///x.db``).

    Schemes are case-blind, and the stores take ``SQLITE://`` or ``PostgreSQL://`` as their
    own; the checks that keep a command from creating a store where none is (a mistyped path,
    another application's database) compare lower-case schemes, so a URL is brought to that
    form once, where it is read, rather than slipping past them.
    """
    found = _SCHEME.match(url)
    if found is None:
        return url
    return found.group(0).lower() + url[found.end() :]


def query_in_file_url(url: str) -> str | None:
    """Why a ``sqlite://`` or ``jsonl://`` URL is refused for holding a ?query or #fragment.

    SQLAlchemy-style options (``?mode=ro``, ``?timeout=5``) are read by no loomflow store: the
    whole text became the file's name, and a new, empty store was made there. A bare path may
    still name a file with ``?`` or ``#`` in it.
    """
    path = url.split("://", 1)[1] if "://" in url else ""
    if "?" not in path and "#" not in path:
        return None
    return (
        f"bad store URL {_masked_url(url)!r}: loomflow reads no ?query or #fragment in a "
        "file URL; give the file's path alone"
    )


def home_in_file_path(url: str) -> str | None:
    """Why a file URL or bare path starting with ``~`` is refused: no shell reads it, so
    ``sqlite:///~/app/journal.db`` made a directory named ``~`` in the working directory and
    a new, empty store in it. ``None`` when the path does not start so."""
    path = url.split("://", 1)[1][1:] if "://" in url else url
    if not path.startswith("~"):
        return None
    return (
        f"bad store path {_masked_url(url)!r}: '~' is not expanded here (no shell reads it), "
        "so it would make a directory named '~' in the working directory; write the home "
        "directory out (sqlite:////home/me/app/journal.db, an absolute path)"
    )


def sqlite_path(url: str) -> str | None:
    """The file a SQLite URL (or bare path) names; ``None`` for other schemes."""
    url = lower_scheme(url)
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
        if not path.startswith("/") or path == "/":
            raise ConfigurationError(f"bad SQLite URL {url!r}: use sqlite:///relative/path.db")
        if (problem := query_in_file_url(url) or home_in_file_path(url)) is not None:
            raise ConfigurationError(problem)
        return path[1:]  # sqlite:///x.db -> x.db ; sqlite:////abs/x.db -> /abs/x.db
    if "://" in url:
        return None
    if (problem := scheme_without_slashes(url) or home_in_file_path(url)) is not None:
        raise ConfigurationError(problem)
    return url


def _check_store_url(url: str, schemes: tuple[str, ...], what: str) -> str:
    """Refuse a store URL no loomflow store would open, at settings time rather than later;
    return it with its scheme in lower case."""
    url = lower_scheme(url)
    head = url.split("://", 1)[0].lower() if "://" in url else None
    if head is None:
        if (problem := scheme_without_slashes(url) or home_in_file_path(url)) is not None:
            raise ValueError(problem)
        if "jsonl" in schemes and url.endswith(".jsonl"):
            return url
        if not url.strip():
            raise ValueError(f"an empty {what} URL")
        return url  # a bare SQLite path
    if head not in schemes:
        listed = ", ".join(f"{s}://" for s in schemes)
        raise ValueError(f"unknown scheme {head}:// in {_masked_url(url)!r}: use {listed}")
    if head in ("sqlite", "jsonl"):
        path = url.split("://", 1)[1]
        if not path.startswith("/") or path == "/":
            raise ValueError(
                f"bad {head} URL {_masked_url(url)!r}: use {head}:///relative/path or "
                f"{head}:////absolute/path"
            )
        if (problem := query_in_file_url(url) or home_in_file_path(url)) is not None:
            raise ValueError(problem)
    if head in ("postgresql", "postgres"):
        try:
            url.encode("utf-8")
        except UnicodeEncodeError:
            # Bytes that are not UTF-8 (an environment variable set from Latin-1 text): the
            # driver fails on them mid-handshake, with a traceback that names no setting.
            raise ValueError(
                f"{_masked_url(url)!r} holds bytes that are not UTF-8 text, which PostgreSQL "
                "cannot be sent"
            ) from None
        netloc = urlsplit(url).netloc
        if "," not in netloc:  # one host; asyncpg also takes a list, which urlsplit cannot
            try:
                _ = urlsplit(url).port  # parsed on access: a port that is not a number raises
            except ValueError:
                raise ValueError(f"bad port in {_masked_url(url)!r}") from None
    return url


# The secrets that have a least length, and what each is called in its error.
_SHORTEST_SECRET = {
    "console_token": (16, "a console token"),
    "telemetry_user_id_key": (16, "the key of hashed user ids"),
    "console_session_secret": (32, "the console's cookie-signing key"),
}


def _bad_settings(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        field, *item = (str(part) for part in error["loc"])
        where = f"LOOMFLOW_{field.upper()}" + "".join(f"[{i}]" for i in item)
        message = error["msg"].removeprefix("Value error, ")  # pydantic's label for ours
        if error["type"] in ("bool_parsing", "bool_type"):
            # pydantic says only "a valid boolean", not which spellings it takes.
            message = "give true or false (or 1/0, yes/no, on/off)"
        problems.append(f"{where}: {_one_line(message)}")
    return "bad setting " + "; ".join(problems)


def _unreadable_setting(exc: SettingsError) -> str:
    """What pydantic-settings could not read, by the variable's name: it decodes a JSON-typed
    setting itself and says only 'error parsing value for field "x" from source "..."'."""
    found = re.search(r'for field "(\w+)"', str(exc))
    if found is None:
        return f"bad setting: {_one_line(str(exc))}"
    return (
        f"bad setting LOOMFLOW_{found[1].upper()}: its value is not the JSON this setting "
        "takes (see `loomflow settings` and docs/settings.md)"
    )


# A line of a .env file that sets (or means to set) a setting: `export` and spaces allowed.
_SETTING_LINE = re.compile(r"\s*(?:export\s+)?(LOOMFLOW_\w+)", re.IGNORECASE)


def env_file_variables(env_file: Any, encoding: str) -> list[tuple[str, str]]:
    """The variables the ``.env`` file(s) define, each with the file; a line meant for a
    setting that python-dotenv cannot parse (an unclosed quote, say) is refused. It would
    skip the line with a warning naming neither the file nor the variable, and the setting
    would quietly keep its default: an audit URL given that way sent the audit log to the
    journal's database instead."""
    if env_file is None:
        return []
    files = [env_file] if isinstance(env_file, str | os.PathLike) else list(env_file)
    found: list[tuple[str, str]] = []
    for file in files:
        try:
            with open(file, encoding=encoding) as stream:
                bindings = list(parse_stream(stream))
        except (OSError, UnicodeDecodeError):  # not there, or reported when it is read
            continue
        for binding in bindings:
            setting = _SETTING_LINE.match(binding.original.string)
            if binding.error and setting is not None:
                raise ConfigurationError(
                    f"bad setting {setting[1].upper()}: line {binding.original.line} of "
                    f"{os.fspath(file)} cannot be parsed (an unclosed quote?), so the setting "
                    "would be ignored; quote the value whole ('...' or \"...\") or not at all"
                )
            if binding.key is not None:
                found.append((binding.key, os.fspath(file)))
    return found


# LOOMFLOW_ variables that are read on purpose but name no setting (the test suite's DSN).
OTHER_VARIABLES = frozenset({"LOOMFLOW_TEST_PG_DSN"})
_reported: set[tuple[str, str]] = set()  # each misspelling once per process, not per Settings()
# Names people guess for the journal's URL (the command line's flag is plain --url), which no
# spelling distance leads to RUNTIME_URL.
_GUESSES = dict.fromkeys(("URL", "DSN", "DATABASE_URL", "DB_URL", "JOURNAL_URL"), "RUNTIME_URL")


def _warn_unknown_variables(in_files: list[tuple[str, str]]) -> None:
    """A ``LOOMFLOW_*`` variable that names no setting is ignored: log it once, with the
    setting it most likely meant. ``LOOMFLOW_LEASE_SECOND=5`` left a service on the default
    lease without a word."""
    names = [name.upper() for name in Settings.model_fields]
    for variable, where in [(v, "") for v in sorted(os.environ)] + in_files:
        # Matched as the settings match them: case-blind (`loomflow_lease_seconds` is read).
        name = variable.upper().removeprefix("LOOMFLOW_")
        if name == variable.upper() or name in names or variable.upper() in OTHER_VARIABLES:
            continue
        if (variable, where) in _reported:
            continue
        _reported.add((variable, where))
        # Compared without the shared prefix, which would make every name look close.
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
        if not close and name in _GUESSES:
            close = [_GUESSES[name]]
        _log.warning(
            "%s%s is not a setting and is ignored%s",
            variable,
            f" in {where}" if where else "",
            f" (did you mean LOOMFLOW_{close[0]}?)" if close else "",
        )


def _unknown_keyword(keyword: str) -> str:
    """Why ``Settings(keyword=...)`` is refused, and the setting it most likely meant."""
    names = list(Settings.model_fields)
    name = keyword.lower().removeprefix("loomflow_")
    if name in names:  # Settings(LOOMFLOW_LEASE_SECONDS=5): the variable's name, not the field's
        return f"Settings() takes the setting {keyword!r} as {name}=, not by its variable's name"
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"Settings() has no setting {keyword!r}{hint}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


class Settings(BaseSettings):
    """Everything an operator may set without touching code."""

    model_config = SettingsConfigDict(
        env_prefix="LOOMFLOW_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        # A value that does not parse may be a URL with a password or a mistyped secret:
        # errors name the setting and the reason, never the value.
        hide_input_in_errors=True,
    )

    def __init__(self, **values: Any) -> None:
        """Read the settings; a value that does not parse is a :class:`ConfigurationError`
        naming its ``LOOMFLOW_*`` variable (pydantic's own error names the field)."""
        if unknown := [
            k for k in values if not k.startswith("_") and k not in type(self).model_fields
        ]:
            # extra="ignore" is for the environment; a keyword in code that names no
            # setting (`Settings(lease_second=5)`) left the default in force without a word.
            raise ConfigurationError(_unknown_keyword(unknown[0]))
        env_file = values.get("_env_file", self.model_config.get("env_file"))
        encoding = values.get("_env_file_encoding", self.model_config.get("env_file_encoding"))
        in_files = env_file_variables(env_file, encoding or "utf-8")
        # Before the values are checked: a typo beside a bad value is reported in the same go.
        _warn_unknown_variables(in_files)
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigurationError(_bad_settings(exc)) from exc
        except SettingsError as exc:  # pydantic-settings could not even read a value
            raise ConfigurationError(_unreadable_setting(exc)) from exc

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
        allow_inf_nan=False,  # inf would never time out, nan compares false to all
        description=(
            "How long a run waits for another run on the same (session, user) to finish "
            "before failing with SessionBusyError."
        ),
    )
    lease_seconds: float = Field(
        default=30.0,
        # At least a second: the heartbeat renews every third of a lease, so a shorter one
        # spins on the database and a GC pause or a slow statement loses the turn.
        ge=1.0,
        allow_inf_nan=False,  # inf would never time out, nan compares false to all
        description=(
            "Ownership lease of a (session, user) turn, renewed while the run is alive "
            "(at least 1 second). A crashed worker's turn is free after this long (at once if "
            "it ran on this host)."
        ),
    )
    recovery_interval_seconds: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,  # inf would never time out, nan compares false to all
        description=(
            "Seconds between a recovery worker's sweeps for orphaned runs (`loomflow worker`, "
            "`Recovery.run_forever`). A crashed run is resumed within about lease_seconds "
            "plus this."
        ),
    )
    recovery_max_attempts: int = Field(
        default=5,
        ge=1,
        description=(
            "Claims of one orphaned run before recovery gives up on it and marks it failed "
            "(a dead letter keeping its last error)."
        ),
    )
    sqlite_busy_timeout_ms: int = Field(
        default=5000,
        ge=0,
        # SQLite keeps the timeout in a C int: a larger value silently became 0, no wait at all.
        le=MAX_BUSY_TIMEOUT_MS,
        description=(
            "SQLite busy_timeout for contended writes, in milliseconds (at most 2147483647, "
            "about 24 days)."
        ),
    )
    sqlite_synchronous: Literal["FULL", "NORMAL", "EXTRA"] = Field(
        default="FULL",
        description="SQLite synchronous pragma; FULL survives power loss in WAL mode.",
    )
    postgres_timeout_seconds: float = Field(
        default=60.0,
        ge=0,
        allow_inf_nan=False,
        description=(
            "How long one PostgreSQL statement (or a new connection) may wait for the server "
            "before it fails with StoreUnavailableError; 0 lets statements wait forever "
            "(connecting then gives up after 60 s). A paused or unreachable server then fails "
            "a run instead of hanging it. Migrations and journal prunes are not bound."
        ),
    )
    auto_migrate: bool = Field(
        default=True,
        description="Apply pending schema migrations when a runtime first connects.",
    )
    journal_retention_days: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        le=MAX_AGE.days,  # 1000 years: beyond it the cutoff is no date (and inf overflows)
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
    otlp_headers: SecretStr | None = Field(
        default=None,
        description=(
            "Extra headers of OTLP export requests, as `name=value,name2=value2` (kept secret: "
            "they usually carry a token)."
        ),
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
        default="127.0.0.1",
        min_length=1,
        description=(
            "Address the metrics endpoint binds. The default keeps it local; a container "
            "scraped from outside sets `0.0.0.0`."
        ),
    )
    telemetry_capture_content: bool = Field(
        default=False,
        description=(
            "Record prompts, completions, tool arguments and tool results on spans. Off by "
            "default: they may hold personal data."
        ),
    )
    telemetry_user_ids: Literal["plain", "hashed", "omit"] = Field(
        default="plain",
        description=(
            "How spans carry the run's user id (`user_id` and `user.id`): `plain`, `hashed` "
            "(an HMAC-SHA-256 prefix keyed by `LOOMFLOW_TELEMETRY_USER_ID_KEY`, so it is "
            "stable across the deployment's processes but cannot be reversed by hashing a "
            "list of candidate ids) or `omit`. Metrics never carry user ids."
        ),
    )
    telemetry_user_id_key: SecretStr | None = Field(
        default=None,
        description=(
            "The secret key (16 characters or more) of `LOOMFLOW_TELEMETRY_USER_IDS=hashed`; "
            "the same on every process of a deployment, so that one user hashes alike."
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
    console_token: SecretStr | None = Field(
        default=None,
        description=(
            "An access token (16 characters or more) of `loomflow console`, with the admin "
            "role; more tokens, with roles, go in a `--tokens-file`. Sent as "
            "`Authorization: Bearer <token>` or typed into the sign-in form."
        ),
    )
    console_session_secret: SecretStr | None = Field(
        default=None,
        description=(
            "The key (32 characters or more) that signs `loomflow console` sign-in cookies. "
            "Unset, each console process draws a random one. Either way a sign-in lives in "
            "the memory of the console process that made it (so that signing out ends it): "
            "a restart signs everyone out, and behind a load balancer each process knows "
            "only its own sign-ins."
        ),
    )
    redact_secrets: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description=(
            "Secret values to redact wherever they appear before the audit log (and loomflow's "
            "logs) store them: comma-separated (`s3cr3t-db-pass,tok-123`) or a JSON list "
            '(`["s3cr3t,with-comma"]`). Values shorter than 4 characters are ignored.'
        ),
    )
    redact_env: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [
            "ANTHROPIC_API_KEY",
            "OPENAI_API_KEY",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "GITHUB_TOKEN",
        ],
        description=(
            "Names of environment variables whose values are secrets to redact like "
            "`redact_secrets` (read when the redactor is built); comma-separated or a JSON list."
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
    redact_patterns: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description=(
            "More personal-data shapes to redact like `redact_pii`, as a JSON object of kind to "
            'regular expression, e.g. \'{"customer_id": "CUST-[0-9]{8}"}\'; a match becomes '
            "`[REDACTED:<kind>]`."
        ),
    )

    @field_validator("console_token", "telemetry_user_id_key", "console_session_secret")
    @classmethod
    def _secret_long_enough(
        cls, secret: SecretStr | None, info: ValidationInfo
    ) -> SecretStr | None:
        # Said in characters: pydantic's own min_length on a SecretStr speaks of "items"
        # ("Value should have at least 16 items after validation").
        shortest, what = _SHORTEST_SECRET[info.field_name or ""]
        if secret is not None and len(secret.get_secret_value()) < shortest:
            raise ValueError(f"{what} must be {shortest} characters or more")
        return secret

    _lists = field_validator("redact_secrets", "redact_env", mode="before")(_text_list)
    _objects = field_validator("redact_patterns", mode="before")(_json_object)

    @field_validator("redact_patterns")
    @classmethod
    def _patterns_compile(cls, patterns: dict[str, str]) -> dict[str, str]:
        for kind, rx in patterns.items():
            try:
                re.compile(rx)
            except re.error as exc:
                raise ValueError(
                    f"pattern {kind!r} is not a valid regular expression: {exc}"
                ) from None
        return patterns

    @field_validator("runtime_url")
    @classmethod
    def _journal_url(cls, url: str) -> str:
        return _check_store_url(url, ("memory", "sqlite", "postgresql", "postgres"), "journal")

    @field_validator("audit_url")
    @classmethod
    def _audit_url(cls, url: str | None) -> str | None:
        schemes = ("memory", "jsonl", "sqlite", "postgresql", "postgres")
        return None if url is None else _check_store_url(url, schemes, "audit")

    @field_validator("budget_url")
    @classmethod
    def _budget_url(cls, url: str | None) -> str | None:
        schemes = ("memory", "sqlite", "postgresql", "postgres")
        return None if url is None else _check_store_url(url, schemes, "budget")

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_endpoint(cls, url: str | None) -> str | None:
        # Checked here, not only when telemetry is set up: a typo would otherwise pass
        # `loomflow settings` and every command, then stop the application at its first agent.
        return None if url is None else check_otlp_url(url)

    @field_validator("otlp_headers")
    @classmethod
    def _otlp_headers(cls, headers: SecretStr | None) -> SecretStr | None:
        if headers is not None:
            check_otlp_headers(headers.get_secret_value())
        return headers

    @field_serializer(*_URL_SETTINGS)
    def _dump_url(self, url: str | None) -> str | None:
        return None if url is None else _masked_url(url)

    def __repr_args__(self) -> Any:
        # pydantic builds repr() and str() from these pairs: passwords in URLs stay out.
        for name, value in super().__repr_args__():
            if name in _URL_SETTINGS and isinstance(value, str):
                value = _masked_url(value)
            yield name, value

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
