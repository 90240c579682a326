"""Audit entries, their canonical form and their hash.

An entry's hash is the SHA-256 of the canonical JSON of every exported field except ``hash``
itself. The exported JSON line of an entry is exactly those fields plus ``hash``. Which
canonical JSON depends on the entry's ``hash_version``:

- **2** (every entry written since 0.21, ``"hash_version": 2`` in its line): RFC 8785, the JSON
  Canonicalization Scheme, which libraries of most languages implement, so an export can be
  re-checked outside Python::

      body = {k: v for k, v in entry.items() if k != "hash"}
      sha256(rfc8785.dumps(body))          # canonicalize(body) in JavaScript

- **3** (every entry written since erasure arrived, ``"hash_version": 3``): RFC 8785 as in
  version 2, but the hash covers a salted digest of the payload, ``payload_digest``, in place
  of the payload; ``payload`` and ``payload_salt`` are left out of what is hashed::

      body = {k: v for k, v in entry.items() if k not in ("hash", "payload", "payload_salt")}
      sha256(rfc8785.dumps(body))
      payload_digest == sha256(rfc8785.dumps({"payload": payload, "salt": payload_salt}))

  So a payload can be erased (``payload`` and ``payload_salt`` become ``null``) while the
  chain still verifies; the 128-bit random salt goes with it, so the digest left behind
  cannot be matched against guessed payloads.

- **1** (older entries, whose line has no ``hash_version``): Python's own spelling,
  ``json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` in UTF-8,
  which other languages do not reproduce for every number and key (``1e-07``, keys beyond
  U+FFFF). Such entries keep verifying in Python; a trail may hold version 1 entries followed
  by version 2 ones.

RFC 8785 writes numbers as IEEE doubles, so an integer beyond 2**53 - 1 would not survive it:
:meth:`AuditRecord.checked` stores such integers as decimal strings, and text that cannot be
UTF-8 (lone surrogates) with U+FFFD in their place.

``prev_hash`` links each entry to the previous entry *of the same user* (``GENESIS`` for the
first), and ``seq`` counts that user's entries from 1 without gaps.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import re
import secrets
from typing import Any, Final

import rfc8785
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from .._ids import check_id, check_key
from .._json import canonical_json, json_safe
from .._printable import escaped_surrogates
from .._timefmt import holdable_seconds
from .._timefmt import iso_time as json_time
from ..errors import AuditError, InvalidArgumentError, UserError

__all__ = [
    "AuditEntry",
    "AuditRecord",
    "DIGESTED_VERSION",
    "ENTRY_SCHEMA_VERSION",
    "GENESIS",
    "HASH_VERSION",
    "HASH_VERSIONS",
    "MAX_JSON_DEPTH",
    "MAX_PAYLOAD_DEPTH",
    "canonical_bytes",
    "canonical_json",
    "entry_hash",
    "json_line",
    "payload_digest",
    "read_json",
    "read_stored_payload",
    "rest_digest",
    "time_us_of_text",
    "too_deep",
    "user_key",
]

ENTRY_SCHEMA_VERSION: Final = 1
"""Version of the entry layout; stored in every entry. Bump it when a field changes meaning."""

GENESIS: Final = "0" * 64
"""``prev_hash`` of a user's first entry."""

HASH_VERSION: Final = 3
"""Hash version of new entries: SHA-256 over RFC 8785 canonical JSON, with the payload hashed
apart (salted) so that it can be erased."""

DIGESTED_VERSION: Final = 3
"""The first hash version whose hash covers a digest of the payload instead of the payload."""

UNREADABLE: Final = "unreadable"
"""The key of an exported line whose stored row is damaged (see ``AuditEntry.unreadable``)."""

HASH_VERSIONS: Final = (1, 2, 3)
"""Every hash version this loomflow can check (1: Python's ``json.dumps`` spelling)."""

MAX_EXACT_INT: Final = 2**53 - 1
"""Largest integer an IEEE double, and so RFC 8785, holds exactly (and its negative)."""


# Raw, these can only stand inside JSON strings, where their escapes mean the same.
_LINE_BREAKS: Final = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def json_line(value: Any) -> str:
    """``value`` as one line of an export: sorted compact JSON, with U+0085, U+2028 and U+2029
    escaped (valid raw in JSON, but ``str.splitlines`` and other line readers break at them).

    A lone surrogate (text read back from a row whose bytes are not UTF-8) is written as its
    JSON escape: UTF-8 cannot spell it, and the line must still say what the row holds, for
    a verifier to report the entry as changed."""
    return escaped_surrogates(canonical_json(value).translate(_LINE_BREAKS))


def canonical_bytes(value: Any, hash_version: int = HASH_VERSION) -> bytes:
    """The bytes a hash of ``hash_version`` is computed over.

    Raises:
        AuditError: ``value`` has no canonical form in that version (a NaN, an integer beyond
            2**53 - 1 in version 2, text that is not valid Unicode, nesting too deep to walk),
            or the version is unknown.
    """
    try:
        if hash_version in (2, 3):
            if _spelled_alike(value):
                # Byte for byte what rfc8785 writes, in C: a 2.6 kB entry hashed in ~100 us
                # rather than ~230 us, and re-hashing is most of verify's time on a long trail.
                return canonical_json(value).encode("utf-8")
            return rfc8785.dumps(value)
        if hash_version == 1:
            return canonical_json(value).encode("utf-8")
    except UnicodeError as exc:
        # Named in the words of the Node verifier's report, whatever the codec said.
        raise AuditError(
            f"no canonical JSON (hash version {hash_version}): {_LONE_SURROGATE}"
        ) from exc
    except (rfc8785.CanonicalizationError, ValueError, TypeError) as exc:
        # rfc8785's own errors are ValueErrors, named for clarity.
        if isinstance(exc.__cause__, UnicodeError):  # rfc8785's "non-UTF-8 codepoints"
            raise AuditError(
                f"no canonical JSON (hash version {hash_version}): {_LONE_SURROGATE}"
            ) from exc
        raise AuditError(f"no canonical JSON (hash version {hash_version}): {exc}") from exc
    except RecursionError:
        # Stored data nested deeper than the walk can go (the parser reads a little deeper
        # than this walk does): damage to report, not a crash of verify or erasure.
        raise AuditError(
            f"no canonical JSON (hash version {hash_version}): it is nested too deep"
        ) from None
    raise AuditError(
        f"unknown audit hash version {hash_version!r}: this loomflow checks versions "
        f"{', '.join(map(str, HASH_VERSIONS))}"
    )


_LONE_SURROGATE: Final = "it holds a lone surrogate, which is not text"


def _spelled_alike(value: Any) -> bool:
    """Whether Python's sorted JSON spelling of ``value`` is its RFC 8785 form.

    It is for strings (both escape exactly ``"``, ``\\`` and the controls below U+0020,
    in the same way), booleans, null, and integers within 2**53 - 1. It may not be for
    floats (``1e-07``, ``5.0``), larger integers (RFC 8785 refuses them), keys beyond U+FFFF
    (sorted by code points here, by UTF-16 units there) or non-string keys; text that is not
    UTF-8 fails the encoding. A test compares both ways on generated data.
    """
    if isinstance(value, str) or value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return -MAX_EXACT_INT <= value <= MAX_EXACT_INT
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or (key and max(key) > "\uffff"):
                return False
            if not _spelled_alike(item):
                return False
        return True
    if isinstance(value, list | tuple):
        return all(_spelled_alike(item) for item in value)
    return False  # floats, and anything else (rfc8785 names what it cannot write)


def user_key(user_id: str | None) -> str:
    """An injective text key of a user (``None``, the anonymous bucket, is ``null``)."""
    return json.dumps(user_id, ensure_ascii=False)


MIN_TIME_US = -62_135_596_800_000_000  # 0001-01-01T00:00:00Z, in microseconds since 1970
MAX_TIME_US = 253_402_300_799_999_999  # 9999-12-31T23:59:59.999999Z


def _within_dates(time_us: int) -> int:
    """``time_us`` held to the years 1 to 9999. Entries are refused outside them, but a row
    edited by hand is shown (and reported by verify) rather than failing every query."""
    return min(max(time_us, MIN_TIME_US), MAX_TIME_US)


def iso_time(time_us: int) -> str:
    """Microseconds since the epoch as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (exact, no float), with
    the zeros of a year before 1000 that every verifier expects (``--since 0001-01-01``)."""
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return json_time(epoch + dt.timedelta(microseconds=_within_dates(time_us)))


def time_us_of_text(text: object) -> int:
    """The microseconds of an exported ``time``, which must be spelled exactly as
    :func:`iso_time` writes it (``2026-05-08T09:14:03.512000Z``).

    Strictly: the hash covers the canonical spelling, so ``...03.5Z`` would be checked as
    ``...03.500000Z``, a line its writer never made (and that other verifiers, reading the
    text as it is, would hash differently).

    Raises:
        ValueError: not a time in that form.
    """
    if not isinstance(text, str) or not text.endswith("Z"):
        raise ValueError(f"bad time {text!r}")
    spelled = f"time {text!r} is not spelled YYYY-MM-DDTHH:MM:SS.ffffffZ"
    try:
        parsed = dt.datetime.strptime(text[:-1], "%Y-%m-%dT%H:%M:%S.%f")
    except ValueError as exc:
        # strptime's own words ("unconverted data remains: 9") name neither field nor value.
        raise ValueError(f"{spelled} ({exc})") from None
    time_us = time_us_of(parsed.replace(tzinfo=dt.UTC))
    if iso_time(time_us) != text:
        raise ValueError(spelled)
    return time_us


def time_us_of(value: dt.datetime | float | int) -> int:
    """A datetime (naive means UTC) or Unix seconds as integer microseconds."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        delta = value - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"a time must be a datetime or Unix seconds, not {value!r}")
    if not holdable_seconds(value):
        # inf, NaN, 1e300: round() would raise, or make an integer no column can bind.
        raise InvalidArgumentError(f"{value!r} Unix seconds is out of range: no date holds it")
    return round(value * 1_000_000)


def _check_text(what: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or (not optional and not value):
        raise UserError(f"{what} must be a {'string or None' if optional else 'non-empty string'}")
    if "\x00" in value:
        raise UserError(f"{what} {value!r} contains a NUL character, which no backend can store")


def portable(value: Any) -> Any:
    """Plain JSON data (from :func:`json_safe`) that RFC 8785 spells the same everywhere.

    Integers beyond 2**53 - 1 become their decimal strings: every JSON reader that parses
    numbers as doubles (JavaScript's among them) would round them, and RFC 8785 refuses them.
    Text that is not valid Unicode (lone surrogates) gets U+FFFD in their place.
    """
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        return str(value) if abs(value) > MAX_EXACT_INT else value
    if isinstance(value, str):
        return _valid_text(value)
    if isinstance(value, dict):
        return {_valid_text(k): portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    return value


def _valid_text(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # Rejoins a pair split into two code points, replaces a lone half.
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


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

    # Strict: b"alice" must not be taken for "alice" (checked() then names a bad id).
    user_id: str | None = Field(strict=True)
    session_id: str | None = Field(default=None, strict=True)
    run_id: str | None = Field(default=None, strict=True)
    actor: str = Field(strict=True)
    action: str = Field(strict=True)
    payload: dict[str, Any] = Field(default_factory=dict)

    def checked(self) -> AuditRecord:
        """Reject ids no backend can store; make the payload plain JSON."""
        check_id("user_id", self.user_id)
        check_id("session_id", self.session_id)
        check_id("run_id", self.run_id)
        _check_text("actor", self.actor, optional=False)
        check_key("action", self.action, optional=False)  # indexed next to the user key
        try:
            payload = portable(json_safe(self.payload))
        except RecursionError:
            raise too_deep(self.action) from None
        if _depth(payload) > MAX_PAYLOAD_DEPTH:
            raise too_deep(self.action)
        return self.model_copy(update={"payload": payload})


MAX_PAYLOAD_DEPTH: Final = 200
"""How many containers deep a payload may nest (the payload object itself is 1).

The walks that hash an entry recurse, and how deep they can go depends on how deep the
caller's stack already is: an entry written near that limit could then be reported as
``edited`` by a ``verify`` that runs with a deeper stack. Refusing deeper payloads when they
are written, well inside the limit, keeps every written entry verifiable. The journal nests
step values at most 100 deep, so the agent's own entries stay far below it."""


def _depth(value: Any) -> int:
    """How many lists and objects deep ``value`` nests, counted without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item)
    return deepest


def too_deep(action: str) -> InvalidArgumentError:
    """The error for a payload nested deeper than :data:`MAX_PAYLOAD_DEPTH`."""
    return InvalidArgumentError(
        f"the payload of the {action[:80]!r} audit entry is nested too deep to store (more "
        f"than {MAX_PAYLOAD_DEPTH} lists and objects deep), or contains itself"
    )


class AuditEntry(BaseModel):
    """One sealed entry of a user's hash chain, as stored and exported.

    Attributes:
        schema_version: Layout version of the entry (:data:`ENTRY_SCHEMA_VERSION`).
        hash_version: How :attr:`hash` is computed: 3 (RFC 8785 over a payload digest, every
            new entry), 2 (RFC 8785 over the payload, 0.21 before erasure) or 1 (entries
            written before 0.21; their exported line has no ``hash_version``).
        user_id: Whose trail this belongs to; a top-level field of every entry.
        seq: Position in the user's trail, from 1, without gaps.
        time: When it was written (UTC, microseconds; the database clock on SQL backends).
        session_id: The session, if any.
        run_id: The run, if any.
        actor: Who acted.
        action: What happened.
        payload: Details, redacted before storage; ``None`` once erased.
        payload_digest: Version 3: SHA-256 of the payload and its salt (what the hash covers).
        payload_salt: Version 3: the random salt of the digest; ``None`` once erased.
        prev_hash: ``hash`` of the user's previous entry (:data:`GENESIS` for the first).
        hash: SHA-256 of the canonical JSON of all the fields above.
        unreadable: Why the stored row this entry was read from is damaged (a payload that is
            no strict JSON, a row no writer makes), else ``None``. No field and never hashed:
            an export writes it as the line's ``"unreadable"`` key, so that ``verify --file``
            (and the Node verifier) report the entry as ``unreadable`` where it is, as
            ``verify`` does on the store, rather than as ``edited``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    _unreadable: str | None = PrivateAttr(default=None)

    schema_version: int = ENTRY_SCHEMA_VERSION
    # 1 is what a row or line from before hash versions existed is; strict, so that ``true``
    # or ``"2"`` in a line is unreadable rather than quietly taken for a version.
    hash_version: int = Field(default=1, strict=True)
    user_id: str | None
    # From 1 (no writer makes 0), and no more than any JSON reader holds exactly (2**53 - 1;
    # a seq that large would take millennia of entries).
    seq: int = Field(ge=1, le=MAX_EXACT_INT)
    # Within the years 1 to 9999, which every reader turns into a date: a row edited to 1e17
    # years reads as unreadable instead of an OverflowError in the middle of a verify.
    time_us: int = Field(exclude=True, ge=MIN_TIME_US, le=MAX_TIME_US)
    session_id: str | None = None
    run_id: str | None = None
    actor: str
    action: str
    payload: dict[str, Any] | None = Field(default_factory=dict)
    payload_digest: str | None = None
    payload_salt: str | None = None
    prev_hash: str
    hash: str

    @model_validator(mode="after")
    def _digest_fields_match_version(self, info: ValidationInfo) -> AuditEntry:
        if info.context and info.context.get(UNREADABLE):
            return self  # a damaged row's line: reported as that, however it was damaged
        # Fields a version does not hash may not appear in it: they would ride along unchecked.
        if self.hash_version < DIGESTED_VERSION:
            if self.payload_digest is not None or self.payload_salt is not None:
                raise ValueError(
                    f"a hash version {self.hash_version} entry has no payload_digest or salt"
                )
        elif self.hash_version == DIGESTED_VERSION and not isinstance(self.payload_digest, str):
            raise ValueError(f"a hash version {self.hash_version} entry needs a payload_digest")
        return self

    @property
    def unreadable(self) -> str | None:
        """Why the row this entry was read from is damaged (``None``: it is not)."""
        return self._unreadable

    def marked_unreadable(self, why: str) -> AuditEntry:
        """This entry, read from a damaged row: ``why`` says what is wrong with it."""
        self._unreadable = why
        return self

    @property
    def erased(self) -> bool:
        """Whether the payload was erased (forgotten, or past retention)."""
        return self.payload is None

    @property
    def time(self) -> dt.datetime:
        """The entry's time as an aware UTC datetime."""
        since = dt.timedelta(microseconds=_within_dates(self.time_us))
        return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + since

    @classmethod
    def seal(
        cls,
        record: AuditRecord,
        *,
        seq: int,
        time_us: int,
        prev_hash: str,
        hash_version: int = HASH_VERSION,
        salt: str | None = None,
    ) -> AuditEntry:
        """Build the entry that follows ``prev_hash`` in its user's chain.

        ``hash_version`` and ``salt`` (version 3; random when left out) exist for test
        vectors; stores always seal new entries in :data:`HASH_VERSION`.

        Raises:
            AuditError: the record has no RFC 8785 form (pass it through
                :meth:`AuditRecord.checked` first, as stores do).
        """
        fields: dict[str, Any] = {
            "schema_version": ENTRY_SCHEMA_VERSION,
            "hash_version": hash_version,
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
        if hash_version >= DIGESTED_VERSION:
            salt = salt if salt is not None else secrets.token_hex(16)
            fields["payload_digest"] = payload_digest(record.payload, salt)
            hashed = {k: v for k, v in fields.items() if k != "payload"}
            return cls(**fields, payload_salt=salt, hash=entry_hash(hashed))
        return cls(**fields, hash=entry_hash(fields))

    def rehashed(self) -> AuditEntry:
        """This entry with its payload digest (version 3) and hash recomputed from its current
        content: what someone rewriting the storage would leave. For tests of ``verify``."""
        fields: dict[str, Any] = {}
        if self.hash_version >= DIGESTED_VERSION and self.payload is not None:
            salt = self.payload_salt or secrets.token_hex(16)
            fields = {"payload_salt": salt, "payload_digest": payload_digest(self.payload, salt)}
        entry = self.model_copy(update=fields)
        return entry.model_copy(update={"hash": entry.computed_hash()})

    def tombstoned(self) -> AuditEntry:
        """This entry with its payload (and salt) erased; hash and links unchanged."""
        return self.model_copy(update={"payload": None, "payload_salt": None})

    def to_json(self) -> dict[str, Any]:
        """The exported form: every field, ``time`` as an ISO 8601 UTC string.

        A version 1 entry has no ``hash_version`` key, exactly as it was exported before
        versions existed (its hash covers the line without one). A version 3 entry adds
        ``payload_digest`` and ``payload_salt``; an erased entry has ``"payload": null``.
        """
        line = self._hashed()
        if self.hash_version >= DIGESTED_VERSION:
            line["payload"] = self.payload
            line["payload_salt"] = self.payload_salt
        if self._unreadable is not None:
            line[UNREADABLE] = self._unreadable
        return {**line, "hash": self.hash}

    def _hashed(self) -> dict[str, Any]:
        body: dict[str, Any] = {"schema_version": self.schema_version}
        if self.hash_version != 1:
            body["hash_version"] = self.hash_version
        body |= {
            "user_id": self.user_id,
            "seq": self.seq,
            "time": iso_time(self.time_us),
            "session_id": self.session_id,
            "run_id": self.run_id,
            "actor": self.actor,
            "action": self.action,
        }
        if self.hash_version >= DIGESTED_VERSION:
            body["payload_digest"] = self.payload_digest
        else:
            body["payload"] = self.payload
        body["prev_hash"] = self.prev_hash
        return body

    def payload_problem(self) -> str | None:
        """Why a version 3 entry's payload does not match its digest (``None``: it does, or
        it was erased, or the entry is older and its hash covers the payload itself)."""
        if self.hash_version < DIGESTED_VERSION or self.payload is None:
            return None
        if not isinstance(self.payload_salt, str) or not isinstance(self.payload_digest, str):
            return "its payload has no salt or digest"
        try:
            if payload_digest(self.payload, self.payload_salt) == self.payload_digest:
                return None
        except AuditError as exc:
            return f"its payload cannot be hashed ({exc})"
        return "its payload no longer matches its digest"

    def rest_digest(self) -> str:
        """SHA-256 of everything the entry's hash covers except the payload.

        An erasure record lists it for each version 1 or 2 entry it erases: their hash covers
        the payload, so once it is gone this is what still vouches for the other fields.
        """
        return rest_digest(self._hashed())

    def to_line(self) -> str:
        """One JSONL line (no newline).

        U+0085, U+2028 and U+2029 are written as escapes: they are valid raw in JSON, but
        ``str.splitlines`` and other line readers break lines at them. Hashes are computed
        over the parsed values, never over the line's bytes, so the spelling is free.
        """
        return json_line(self.to_json())

    @classmethod
    def from_json(cls, data: dict[str, Any], *, exported: bool = False) -> AuditEntry:
        """Parse an exported line's object (raises ``ValueError`` on a malformed one).

        Strictly: a line that says ``"seq": "2"`` or ``"seq": 3.0``, or spells its time
        another way, is not the entry its writer hashed, and a lax parse would hash the value
        it was coerced to instead (the Node verifier, reading the line as it is, would
        disagree).

        ``exported``: the line is from an export, where an ``"unreadable"`` key marks an entry
        whose row could not be read (see :attr:`unreadable`); anywhere else (a JSONL store's
        own file) no writer puts it there, and it is a field no entry has.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        if exported and UNREADABLE in data and "hash" not in data:
            # The marker an export writes for a row that read as no entry (damaged_row): no
            # entry to check, and the line says which row and why.
            said = json.dumps(data[UNREADABLE], ensure_ascii=False)[:200]
            raise ValueError(f"a row the exporter could not read: {said}")
        body = dict(data)
        when = body.pop("time", None)
        if when is None:
            raise ValueError("no time")
        why = body.pop(UNREADABLE, None) if exported else None
        if exported and UNREADABLE in data and not isinstance(why, str):
            raise ValueError(f"{UNREADABLE} is not text")
        entry = cls.model_validate(
            {**body, "time_us": time_us_of_text(when)},
            strict=True,
            context={UNREADABLE: why is not None},
        )
        return entry if why is None else entry.marked_unreadable(why)

    @classmethod
    def from_line(cls, line: str | bytes, *, exported: bool = False) -> AuditEntry:
        """Parse one exported line (raises ``ValueError`` or ``RecursionError`` when it is
        not an entry).

        JSON as RFC 8259 has it, read strictly (:func:`read_json`): a key given twice, ``NaN``,
        ``Infinity`` or a number beyond a double's range make the line unreadable here as they
        do for the Node verifier. ``exported``: as :meth:`from_json` has it.
        """
        return cls.from_json(read_json(line), exported=exported)

    def canonical_bytes(self) -> bytes:
        """The bytes :attr:`hash` is the SHA-256 of, in the entry's own hash version.

        Raises:
            AuditError: the content has no canonical form in that version (tampered data).
        """
        return canonical_bytes(self._hashed(), self.hash_version)

    def computed_hash(self) -> str:
        """The hash this entry's content should have (compare with :attr:`hash`).

        Raises:
            AuditError: as :meth:`canonical_bytes`.
        """
        return hashlib.sha256(self.canonical_bytes()).hexdigest()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                # ASCII, so that a report naming any key can be printed anywhere.
                raise ValueError(f"the key {json.dumps(key)[:80]} is given twice in one object")
            seen.add(key)
    return found


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is beyond the range of JSON readers")
    return value


MAX_JSON_DEPTH: Final = 256
"""How many lists and objects deep a line or stored payload may nest to be read at all.

Python's parser and the walks that hash an entry recurse, so how deep they go depends on how
deep the caller's stack already is, while JavaScript reads any depth: a line nested some 900
deep was unreadable to ``verify --file`` (its user and seq unknown, so the next entry was
reported as ``missing``, deleted) and ``edited`` to the Node verifier. Both refuse deeper
text, the same way, well inside those limits and above what is written
(:data:`MAX_PAYLOAD_DEPTH`)."""

_NESTING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]|[\]}]', re.S)


def _check_nesting(text: str | bytes) -> None:
    """Refuse JSON text nested deeper than :data:`MAX_JSON_DEPTH` (strings skipped)."""
    if isinstance(text, bytes):
        if text.count(b"[") + text.count(b"{") <= MAX_JSON_DEPTH:
            return
        text = text.decode("utf-8", "surrogateescape")  # bytes that are not: json refuses them
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:  # the usual case
        return
    depth = 0
    for found in _NESTING.finditer(text):
        first = found.group()[0]
        if first in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"it is nested more than {MAX_JSON_DEPTH} lists and objects deep")
        elif first != '"':
            depth -= 1


def read_json(text: str | bytes) -> Any:
    """JSON as RFC 8259 has it, read strictly, as every audit line and stored payload is.

    Python's parser takes what a careful reader must not: a key twice in one object (at any
    depth) keeps the last value, where SQLite's ``json_extract`` and others read the first, so
    one stored text would be two different entries; ``NaN`` and ``Infinity``; and numbers
    beyond a double's range (``1e400``), read as infinity. Each is a ``ValueError`` here (the
    Node verifier refuses the same), as is text nested more than :data:`MAX_JSON_DEPTH` deep.

    Raises:
        ValueError: not such JSON (``RecursionError``: nested too deep to parse).
    """
    _check_nesting(text)
    return json.loads(
        text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant, parse_float=_finite
    )


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def read_stored_payload(text: str | bytes) -> Any:
    """A payload column's JSON (:func:`read_json`), which must also be text: a lone surrogate
    (``"\\ud800"``), which no writer stores, could not be written to an export or a
    terminal.

    Raises:
        ValueError: not such JSON (``RecursionError``: nested too deep to parse).
    """
    data = read_json(text)
    # Rare (or a blob SQLite was given by hand): only then is the whole value checked.
    if not isinstance(text, str) or _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError("it holds a lone surrogate, which is not text") from exc
    return data


def unreadable_reason(exc: BaseException) -> str:
    """Why stored data is not an entry, in one line: each field pydantic refused, and why."""
    if isinstance(exc, ValidationError):
        fields = [
            f"{'.'.join(str(part) for part in error['loc']) or 'entry'}: {error['msg']}"
            for error in exc.errors(include_url=False)
        ]
        return "; ".join(fields)[:300]
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def entry_hash(fields: dict[str, Any]) -> str:
    """SHA-256 (hex) of an entry's fields (``time_us`` for ``time``; ``hash`` excluded).

    ``hash_version`` picks the canonical JSON; left out, or 1, it is version 1, and the body
    hashed has no ``hash_version`` key (as version 1 entries never had one).

    Raises:
        AuditError: the fields have no canonical form in that version.
    """
    body = {k: v for k, v in fields.items() if k not in ("time_us", "hash")}
    body["time"] = iso_time(int(fields["time_us"]))
    version = body.pop("hash_version", 1)
    if version != 1:
        body["hash_version"] = version
    return hashlib.sha256(canonical_bytes(body, version)).hexdigest()


def payload_digest(payload: dict[str, Any] | None, salt: str) -> str:
    """SHA-256 (hex) of ``{"payload": payload, "salt": salt}`` in RFC 8785 form (version 3).

    Raises:
        AuditError: the payload has no canonical form.
    """
    return hashlib.sha256(canonical_bytes({"payload": payload, "salt": salt}, 3)).hexdigest()


def rest_digest(body: dict[str, Any]) -> str:
    """SHA-256 (hex) of an entry's hashed body without ``payload``, in RFC 8785 form."""
    rest = {k: v for k, v in body.items() if k != "payload"}
    return hashlib.sha256(canonical_bytes(rest, 3)).hexdigest()
