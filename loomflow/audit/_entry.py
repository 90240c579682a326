"""Audit entries, their canonical form and their hash.

An entry's hash is the SHA-256 of the canonical JSON of every exported field except ``hash``
itself (keys sorted, no spaces, UTF-8). The exported JSON line of an entry is exactly those
fields plus ``hash``, so anyone can re-check an export with a few lines of any language::

    body = {k: v for k, v in entry.items() if k != "hash"}
    sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False))

``prev_hash`` links each entry to the previous entry *of the same user* (``GENESIS`` for the
first), and ``seq`` counts that user's entries from 1 without gaps.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field

from .._ids import check_id, check_key
from .._json import canonical_json, json_safe
from ..errors import UserError

__all__ = [
    "ENTRY_SCHEMA_VERSION",
    "GENESIS",
    "AuditEntry",
    "AuditRecord",
    "canonical_json",
    "entry_hash",
    "user_key",
]

ENTRY_SCHEMA_VERSION: Final = 1
"""Version of the entry layout; stored in every entry. Bump it when a field changes meaning."""

GENESIS: Final = "0" * 64
"""``prev_hash`` of a user's first entry."""


def user_key(user_id: str | None) -> str:
    """An injective text key of a user (``None``, the anonymous bucket, is ``null``)."""
    return json.dumps(user_id, ensure_ascii=False)


def iso_time(time_us: int) -> str:
    """Microseconds since the epoch as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (exact, no float)."""
    seconds, micros = divmod(time_us, 1_000_000)
    stamp = dt.datetime(1970, 1, 1) + dt.timedelta(seconds=seconds)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S") + f".{micros:06d}Z"


def time_us_of(value: dt.datetime | float | int) -> int:
    """A datetime (naive means UTC) or Unix seconds as integer microseconds."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        delta = value - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"a time must be a datetime or Unix seconds, not {value!r}")
    return round(value * 1_000_000)


def _check_text(what: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or (not optional and not value):
        raise UserError(f"{what} must be a {'string or None' if optional else 'non-empty string'}")
    if "\x00" in value:
        raise UserError(f"{what} {value!r} contains a NUL character, which no backend can store")


class AuditRecord(BaseModel):
    """What a writer hands to the store; the store seals it into an :class:`AuditEntry`.

    Attributes:
        user_id: Whose trail this belongs to (``None`` is the anonymous bucket).
        session_id: The session, if any.
        run_id: The run, if any.
        actor: Who acted: ``agent:<name>``, ``policy:<name>``, ``approver:<id>``, ...
        action: What happened, e.g. ``tool.call`` (see ``loomflow.audit.actions``).
        payload: JSON data describing it, already redacted.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    user_id: str | None
    session_id: str | None = None
    run_id: str | None = None
    actor: str
    action: str
    payload: dict[str, Any] = Field(default_factory=dict)

    def checked(self) -> AuditRecord:
        """Reject ids no backend can store; make the payload plain JSON."""
        check_id("user_id", self.user_id)
        check_id("session_id", self.session_id)
        check_id("run_id", self.run_id)
        _check_text("actor", self.actor, optional=False)
        check_key("action", self.action, optional=False)  # indexed next to the user key
        return self.model_copy(update={"payload": json_safe(self.payload)})


class AuditEntry(BaseModel):
    """One sealed entry of a user's hash chain, as stored and exported.

    Attributes:
        schema_version: Layout version of the entry (:data:`ENTRY_SCHEMA_VERSION`).
        user_id: Whose trail this belongs to; a top-level field of every entry.
        seq: Position in the user's trail, from 1, without gaps.
        time: When it was written (UTC, microseconds; the database clock on SQL backends).
        session_id: The session, if any.
        run_id: The run, if any.
        actor: Who acted.
        action: What happened.
        payload: Details, redacted before storage.
        prev_hash: ``hash`` of the user's previous entry (:data:`GENESIS` for the first).
        hash: SHA-256 of the canonical JSON of all the fields above.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = ENTRY_SCHEMA_VERSION
    user_id: str | None
    seq: int
    time_us: int = Field(exclude=True)
    session_id: str | None = None
    run_id: str | None = None
    actor: str
    action: str
    payload: dict[str, Any] = Field(default_factory=dict)
    prev_hash: str
    hash: str

    @property
    def time(self) -> dt.datetime:
        """The entry's time as an aware UTC datetime."""
        return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=self.time_us)

    @classmethod
    def seal(cls, record: AuditRecord, *, seq: int, time_us: int, prev_hash: str) -> AuditEntry:
        """Build the entry that follows ``prev_hash`` in its user's chain."""
        fields: dict[str, Any] = {
            "schema_version": ENTRY_SCHEMA_VERSION,
            "user_id": record.user_id,
            "seq": seq,
            "time_us": time_us,
            "session_id": record.session_id,
            "run_id": record.run_id,
            "actor": record.actor,
            "action": record.action,
            "payload": record.payload,
            "prev_hash": prev_hash,
        }
        return cls(**fields, hash=entry_hash(fields))

    def to_json(self) -> dict[str, Any]:
        """The exported form: every field, ``time`` as an ISO 8601 UTC string."""
        return {
            "schema_version": self.schema_version,
            "user_id": self.user_id,
            "seq": self.seq,
            "time": iso_time(self.time_us),
            "session_id": self.session_id,
            "run_id": self.run_id,
            "actor": self.actor,
            "action": self.action,
            "payload": self.payload,
            "prev_hash": self.prev_hash,
            "hash": self.hash,
        }

    def to_line(self) -> str:
        """One JSONL line (no newline)."""
        return canonical_json(self.to_json())

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AuditEntry:
        """Parse an exported line's object (raises ``ValueError`` on a malformed one)."""
        body = dict(data)
        when = body.pop("time")
        if not isinstance(when, str) or not when.endswith("Z"):
            raise ValueError(f"bad time {when!r}")
        parsed = dt.datetime.strptime(when[:-1], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=dt.UTC)
        return cls(**body, time_us=time_us_of(parsed))

    def computed_hash(self) -> str:
        """The hash this entry's content should have (compare with :attr:`hash`)."""
        return entry_hash(
            {
                "schema_version": self.schema_version,
                "user_id": self.user_id,
                "seq": self.seq,
                "time_us": self.time_us,
                "session_id": self.session_id,
                "run_id": self.run_id,
                "actor": self.actor,
                "action": self.action,
                "payload": self.payload,
                "prev_hash": self.prev_hash,
            }
        )


def entry_hash(fields: dict[str, Any]) -> str:
    """SHA-256 (hex) of an entry's exported fields, ``hash`` excluded."""
    body = {k: v for k, v in fields.items() if k not in ("time_us", "hash")}
    body["time"] = iso_time(int(fields["time_us"]))
    return hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()
