"""Checking an exported audit trail without the store: what an auditor handed a file runs.

``loomflow audit export`` writes each entry as one JSON line in its exported form (see
:mod:`loomflow.audit._entry`); :func:`verify_lines` re-checks such a file with the same rules
``AuditStore.verify`` applies to the store, plus, optionally, against chain heads copied away
earlier (the ``heads`` of a ``loomflow audit verify --json`` report).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from .._ids import check_id, check_key
from ..errors import InvalidArgumentError
from ._entry import (
    MAX_EXACT_INT,
    AuditEntry,
    read_json,
    time_us_of_text,
    unreadable_reason,
    user_key,
)
from ._store import (
    ANY_USER,
    EXPORT_FILTERS,
    EXPORT_FORMAT,
    EXPORT_HEADER,
    ChainHead,
    ChainProblem,
    VerifyReport,
    _ChainCheck,
    _saved_by_user,
    _span,
)

__all__ = ["heads_from_json", "read_export_header", "verify_lines"]


def verify_lines(
    lines: Iterable[str],
    *,
    heads: Iterable[ChainHead] | None = None,
    user_id: str | None = ANY_USER,
) -> VerifyReport:
    """Check exported audit lines: every hash, every link, no gap, every saved head.

    Each line is re-hashed in its own ``hash_version`` (3: RFC 8785 over a payload digest;
    2: RFC 8785; a line without one is version 1, Python's spelling), so an export may mix
    entries from before and after 0.21. An erased payload (``"payload": null``) must be
    covered by an ``audit.erasure`` entry of the same user after it in the export (its
    ``before`` cut-off reaches the entry, or its ``seqs`` list it).

    Each user's entries are checked in ``seq`` order, as a store's are, with their line
    numbers as positions: a line that is not where an export writes it is ``reordered``, as
    on the store. An export need not start at a user's first entry (``--since`` a date): the
    first entry's link to the one before is then unchecked, and a warning says so; under a
    header naming no filter that starts a trail later (only ``user_id``, ``until``), entries
    are never deleted, so a trail starting past entry 1 is ``missing`` its first. Filters
    that pick entries from the middle of a trail (``--session``, ``--action``) leave gaps,
    which are reported as ``missing``: verify exports of whole trails or time ranges.

    Which users an export covers is the caller's word, never the file's: without
    ``user_id`` it is the whole log, and every user with a saved head must have lines in it;
    with ``user_id``, it is that user's trail alone. An export made with filters starts with
    a header line naming them (see :meth:`AuditFilter.export_header`). No hash covers that
    line, so it narrows nothing: it is reported (``export_filters``), and a line its filters
    exclude is an ``outside_export`` problem, as is, with ``user_id``, a line of another
    user. A header naming a user, read without ``user_id``, gets an ``unscoped`` warning
    that says which ``--user`` checks the export alone.

    Args:
        lines: The export's lines (a file object works); blank lines are skipped. Open the
            file with ``errors="surrogateescape"``: a line holding bytes that are not UTF-8
            is then ``unreadable`` where it is, instead of stopping the whole check.
        heads: Heads recorded earlier. Trails keep growing after a head is saved, so the
            export may go on past it, but the entry at each saved head's ``seq`` must be the
            one it names (else ``head_mismatch``: the trail was rewritten), and an export that
            stops short of a saved head is ``truncated``, as is one that holds none of the
            entries of a user with a saved head (of ``user_id`` alone, if given). Given (even
            empty: heads saved from an empty or another log), each user none of them covers
            gets an ``unanchored`` warning.
        user_id: Only this user's lines and saved heads (``None`` is the anonymous bucket):
            the export is taken to be this user's trail, and other users' lines in it are
            ``outside_export``.

    Returns:
        The report; ``ok`` is true when nothing is wrong. ``position`` is the line number;
        ``export_filters`` holds the filters the export's header names.

    Example:
        ``loomflow audit export --user alice -o alice.jsonl``, checked against every user's
        saved heads::

            with open("alice.jsonl", encoding="utf-8", errors="surrogateescape") as lines:
                verify_lines(lines, heads=heads, user_id="alice")
    """
    only = None
    if user_id is not ANY_USER:
        check_id("user_id", user_id)
        only = user_key(user_id)
    given = heads is not None
    heads = list(heads or ())
    saved = _saved_by_user(heads, only)
    report = VerifyReport()
    checks: dict[str, _ChainCheck] = {}
    # Each user's entries are checked in seq order, with their line numbers as positions, as
    # a store's are: a line moved elsewhere in the file is then "reordered" (as on the
    # store), not a deleted entry plus a duplicate, and one line with a huge seq is one gap.
    trails: dict[str, list[tuple[int, int, AuditEntry]]] = {}
    outside: dict[str, _Outside] = {}  # by user key, in the order of their first such line
    header_at: int | None = None
    filters: dict[str, Any] = {}  # the header's, if any
    times: dict[str, int] = {}  # its since and until, in microseconds
    first = True
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        not_text = _not_utf8(line)
        if not_text is not None:
            # Reported where it is, like any line that is not an entry: the rest of the file,
            # every other user's trail included, is still checked.
            first = False
            report.problems.append(
                ChainProblem(None, "unreadable", None, number, f"not an audit entry: {not_text}")
            )
            continue
        if first:
            first = False
            try:
                report.export_filters = read_export_header(line)
            except ValueError as exc:
                report.problems.append(
                    ChainProblem(
                        None,
                        "unreadable",
                        None,
                        number,
                        f"not an export header this loomflow reads: {exc}"[:320],
                    )
                )
                continue
            if report.export_filters is not None:
                header_at = number
                filters = report.export_filters
                # Read once: read_export_header checked that they parse.
                times = {
                    name: time_us_of_text(value)
                    for name, value in filters.items()
                    if name in ("since", "until")
                }
                continue
        try:
            entry = AuditEntry.from_line(line, exported=True)
        # RecursionError: a line nested too deep for the JSON parser is damage, not a crash.
        except (ValueError, TypeError, KeyError, ValidationError, RecursionError) as exc:
            detail = unreadable_reason(exc)
            report.problems.append(
                ChainProblem(None, "unreadable", None, number, f"not an audit entry: {detail}")
            )
            continue
        key = user_key(entry.user_id)
        reasons = _outside_reasons(entry, key, only, user_id, filters, times)
        if reasons:
            if key in outside:
                outside[key].more += 1
            else:
                outside[key] = _Outside(number, entry, reasons)
        if only is None or key == only:
            trails.setdefault(key, []).append((entry.seq, number, entry))
    # Entries are never deleted, so an export whose header names no filter that starts a
    # trail later holds each trail from entry 1: one starting later lost its first lines.
    from_start = report.export_filters is not None and not set(filters) - {"user_id", "until"}
    for key, trail in trails.items():
        for _seq, number, entry in sorted(trail, key=lambda item: (item[0], item[1])):
            _feed_line(checks, key, number, entry, saved, report, from_start)
    _finish_lines(checks, saved, report, given)
    for found in outside.values():
        report.problems.append(found.problem())
    named = (report.export_filters or {}).get("user_id", ANY_USER)
    if only is None and named is not ANY_USER:
        report.warnings.append(ChainProblem(named, "unscoped", None, header_at, _unscoped(named)))
    return report


def _not_utf8(line: str) -> str | None:
    """Why ``line`` is not UTF-8 text, or ``None`` if it is.

    An export opened with ``errors="surrogateescape"`` (as ``verify --file`` opens it) keeps
    each byte that is not UTF-8 as a lone surrogate, so the line says which byte it was.
    """
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        try:
            line.encode("utf-8", "surrogateescape").decode("utf-8")
        except UnicodeError as exc:
            return f"the line is not UTF-8 text ({exc})"
        return "the line is not UTF-8 text"  # pragma: no cover - encode refused it above
    return None


def read_export_header(line: str) -> dict[str, Any] | None:
    """The filters an export's header line names, or ``None`` if ``line`` is not a header.

    Raises:
        ValueError: a header (it has the header's key) that this loomflow cannot read: another
            format, filters it does not know, or values no export is made with (an id
            ``--user`` refuses, a time not spelled as entries spell it).
    """
    try:
        # Strictly, as entries are read: a header with a key twice is no header, and its line
        # is then reported as not an entry either.
        data = read_json(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or EXPORT_HEADER not in data:
        return None
    version, filters = data.get(EXPORT_HEADER), data.get("filters")
    if type(version) is not int or version != EXPORT_FORMAT:
        raise ValueError(f"format {version!r}, where this loomflow reads {EXPORT_FORMAT}")
    extra = sorted(set(data) - {EXPORT_HEADER, "filters"})
    if extra:
        raise ValueError(f"it has {', '.join(map(repr, extra))}")
    if not isinstance(filters, dict):
        raise ValueError("its filters are not an object")
    for name, value in filters.items():
        if name not in EXPORT_FILTERS:
            raise ValueError(f"unknown filter {name!r}")
        if not isinstance(value, str) and not (name == "user_id" and value is None):
            raise ValueError(f"filter {name} is {value!r}, not text")
        # As the exporter checked them (AuditFilter.build): a line is compared with them.
        if name in ("since", "until"):
            time_us_of_text(value)
        elif name == "after_seq":
            digits = str(value)  # text, as checked above (only user_id may be null)
            if not (digits.isascii() and digits.isdigit() and len(digits) <= 19):
                raise ValueError(f"filter after_seq is {value!r}, not an entry number")
        elif name == "action":
            check_key(name, value)
        else:
            check_id(name, value)
    return filters


@dataclass(slots=True)
class _Outside:
    """A user's lines that the export should not hold: the first of them, and how many more."""

    number: int
    entry: AuditEntry
    reasons: list[str]
    more: int = 0

    def problem(self) -> ChainProblem:
        also = ""
        if self.more:
            also = f" (as {'is' if self.more == 1 else 'are'} {self.more} more "
            also += f"line{'' if self.more == 1 else 's'} of this user)"
        return ChainProblem(
            self.entry.user_id,
            "outside_export",
            self.entry.seq,
            self.number,
            f"entry {self.entry.seq} is outside the export: {'; '.join(self.reasons)}{also}",
        )


def _outside_reasons(
    entry: AuditEntry,
    key: str,
    only: str | None,
    user_id: str | None,
    filters: Mapping[str, Any],
    times: Mapping[str, int],
) -> list[str]:
    """Why the export should not hold ``entry``: not the user it is checked as (``only``),
    or excluded by a filter its header names (an empty list: it belongs)."""
    reasons = []
    if only is not None and key != only:
        reasons.append(f"it is checked as {_trail_of(user_id)} alone ({_option(user_id)})")
    for name, value in filters.items():
        if not _kept(entry, key, name, value, times):
            reasons.append(f"its header says {name} {user_key(value)}")
    return reasons


def _kept(
    entry: AuditEntry, key: str, name: str, value: str | None, times: Mapping[str, int]
) -> bool:
    """Whether ``entry`` passes one filter of a header, as :meth:`AuditFilter.matches` tests
    it (``times``: the header's ``since`` and ``until`` in microseconds)."""
    if name == "user_id":
        return key == user_key(value)
    if name == "session_id":
        return entry.session_id == value
    if name == "run_id":
        return entry.run_id == value
    if name == "action":
        action = str(value)  # read_export_header: only user_id may be null
        if action.endswith("*"):  # a family, as export --action 'tool.*' writes it
            return entry.action.startswith(action[:-1])
        return entry.action == action
    if name == "since":
        return entry.time_us >= times[name]
    if name == "after_seq":
        return entry.seq > int(str(value))
    return entry.time_us < times[name]  # until


def _trail_of(user_id: str | None) -> str:
    """A user's trail as messages name it (JSON spelling, as the Node verifier's messages)."""
    if user_id is None:
        return "the anonymous bucket's trail"
    return f"the trail of {user_key(user_id)}"


def _option(user_id: str | None) -> str:
    """The ``verify --file`` option that checks an export as this user's trail alone."""
    return "--anonymous" if user_id is None else f"--user {user_key(user_id)}"


def _unscoped(named: str | None) -> str:
    """The hint for an export whose header names a user, checked without one."""
    option = "--anonymous" if named is None else "--user"
    return (
        f"the export says it holds only {_trail_of(named)}, but without {option} it is "
        f"checked as the whole log: pass {_option(named)} to check it alone"
    )


def _feed_line(
    checks: dict[str, _ChainCheck],
    key: str,
    number: int,
    entry: AuditEntry,
    saved: Mapping[str, Any],
    report: VerifyReport,
    from_start: bool,
) -> None:
    """Check one line's entry against its user's chain (begun at its first seq; at 1 when
    ``from_start``: the header names no filter that begins a trail later)."""
    check = checks.get(key)
    if check is None:
        check = checks[key] = _ChainCheck(key, entry.user_id, saved.get(key, ()))
        report.users += 1
        if entry.seq > 1:
            check.start_at(entry)
            if from_start:
                report.problems.append(
                    ChainProblem(
                        entry.user_id,
                        "missing",
                        1,
                        number,
                        f"{_span(1, entry.seq - 1)} {'is' if entry.seq == 2 else 'are'} missing "
                        f"before entry {entry.seq}: the export's header names no since, "
                        "session, run or action, so it holds the trail from its start",
                    )
                )
            else:
                report.warnings.append(
                    ChainProblem(
                        entry.user_id,
                        "unanchored",
                        entry.seq,
                        number,
                        f"the export starts at entry {entry.seq}: its link to entry "
                        f"{entry.seq - 1} cannot be checked here",
                    )
                )
    if entry.unreadable is not None:
        # A row the exporter could not read (its line says why): reported as verify reports
        # it on the store, in its place, and the chain goes on past it.
        problem = ChainProblem(
            entry.user_id,
            "unreadable",
            entry.seq,
            number,
            f"entry {entry.seq} was exported unreadable: {json.dumps(entry.unreadable)[:300]}",
        )
        report.problems.append(problem)
        check.skip(number, problem, report)
        return
    report.entries += 1
    check.feed(number, entry, report)


def _finish_lines(
    checks: dict[str, _ChainCheck],
    saved: Mapping[str, Any],
    report: VerifyReport,
    with_heads: bool,
) -> None:
    """What can be told only at the end: saved heads reached, erasures recorded.

    Every user in ``saved`` is looked for: which users an export covers is the caller's
    ``user_id`` (by which ``saved`` was narrowed), never what the file says of itself.
    ``with_heads``: heads were given, so a user none of them covers is warned of.
    """
    for key, user_heads in saved.items():
        found = checks.get(key)
        last = max(user_heads, key=lambda h: h.seq)
        report.heads.extend(user_heads)
        if found is None:
            report.problems.append(
                ChainProblem(
                    last.user_id,
                    "truncated",
                    1,
                    None,
                    f"the export holds none of this user's entries, though a saved head "
                    f"records seq {last.seq}",
                )
            )
            continue
        found.finish_saved(report)
        if found.last_seq > last.seq:
            # The normal case for a growing trail, but nothing vouches for those entries yet.
            tail = _span(last.seq + 1, found.last_seq)
            report.warnings.append(
                ChainProblem(
                    found.user_id,
                    "unanchored",
                    last.seq + 1,
                    None,
                    f"{tail} {'comes' if last.seq + 1 == found.last_seq else 'come'} after the "
                    f"last saved head (seq {last.seq}): a later saved head would cover "
                    f"{'it' if last.seq + 1 == found.last_seq else 'them'}",
                )
            )
    for key, check in checks.items():
        if with_heads and key not in saved and check.first_seq is not None:
            # Heads of another log, or with this user's cut out: nothing vouches for the trail.
            report.warnings.append(
                ChainProblem(
                    check.user_id,
                    "unanchored",
                    check.first_seq,
                    None,
                    f"{_span(check.first_seq, check.last_seq)}: no saved head covers this "
                    f"user's trail",
                )
            )
    for check in checks.values():
        check.finish_erasures(report)


def heads_from_json(data: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> list[ChainHead]:
    """Heads from a ``verify --json`` report (its ``heads``) or from a list of such objects.

    Raises:
        InvalidArgumentError: an item lacks ``seq`` or ``hash``, or has one of the wrong type
            (a ``seq`` that is no whole number from 1 to 2**53 - 1, a ``hash`` that is not
            text; a ``ValueError``).
    """
    items = data.get("heads", []) if isinstance(data, Mapping) else data
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise InvalidArgumentError(f"not a list of chain heads: {items!r:.100}")
    heads = []
    for item in items:
        try:
            if not isinstance(item, Mapping):
                raise TypeError(type(item).__name__)
            user_id = item.get("user_id")
            if user_id is not None and not isinstance(user_id, str):
                raise TypeError("user_id")
            heads.append(ChainHead(user_id, _head_seq(item["seq"]), _head_hash(item["hash"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"not a chain head: {item!r:.200}") from exc
    return heads


def _head_seq(value: object) -> int:
    """A saved head's ``seq``: a whole number a JSON reader holds exactly (``3.0`` is 3, as
    JavaScript reads it). ``True``, ``"3"``, infinity (``1e400`` in the file) and numbers
    past 2**53 - 1 are refused rather than turned into some other seq, as the Node verifier
    refuses them; so is a seq below 1, which no entry has (``verify --json`` never saves
    one): it would check nothing and pass."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or not 1 <= value <= MAX_EXACT_INT:
        raise ValueError("seq")
    return value


def _head_hash(value: object) -> str:
    if not isinstance(value, str):  # null is no hash (it was compared as "None")
        raise TypeError("hash")
    return value
