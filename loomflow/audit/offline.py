"""Checking an exported audit trail without the store: what an auditor handed a file runs.

``loomflow audit export`` writes each entry as one JSON line in its exported form (see
:mod:`loomflow.audit._entry`); :func:`verify_lines` re-checks such a file with the same rules
``AuditStore.verify`` applies to the store, plus, optionally, against chain heads copied away
earlier (the ``heads`` of a ``loomflow audit verify --json`` report).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from .._ids import check_id
from ..errors import InvalidArgumentError
from ._entry import AuditEntry, unreadable_reason, user_key
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
    heads: Iterable[ChainHead] = (),
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
    first entry's link to the one before is then unchecked, and a warning says so. Filters
    that pick entries from the middle of a trail (``--session``, ``--action``) leave gaps,
    which are reported as ``missing``: verify exports of whole trails or time ranges.

    Which users an export covers: an export made with filters starts with a header line
    naming them (see :meth:`AuditFilter.export_header`); with a ``user_id`` among them, it
    covers that user only. Without a header the export is the whole log (the JSONL store's
    own file, or an export made before headers) and covers every user.

    Args:
        lines: The export's lines (a file object works); blank lines are skipped.
        heads: Heads recorded earlier. Trails keep growing after a head is saved, so the
            export may go on past it, but the entry at each saved head's ``seq`` must be the
            one it names (else ``head_mismatch``: the trail was rewritten), and an export that
            stops short of a saved head is ``truncated``, as is one that holds none of the
            entries of a user it covers who has a saved head. The saved heads of users the
            export does not cover, and who have no line in it, are not looked for.
        user_id: Only this user's lines and saved heads (``None`` is the anonymous bucket);
            the export is then taken to cover this user, whatever its header says.

    Returns:
        The report; ``ok`` is true when nothing is wrong. ``position`` is the line number;
        ``export_filters`` holds the filters the export's header names.
    """
    only = None
    if user_id is not ANY_USER:
        check_id("user_id", user_id)
        only = user_key(user_id)
    saved = _saved_by_user(heads, only)
    report = VerifyReport()
    checks: dict[str, _ChainCheck] = {}
    # Each user's entries are checked in seq order, with their line numbers as positions, as
    # a store's are: a line moved elsewhere in the file is then "reordered" (as on the
    # store), not a deleted entry plus a duplicate, and one line with a huge seq is one gap.
    trails: dict[str, list[tuple[int, int, AuditEntry]]] = {}
    first = True
    for number, line in enumerate(lines, 1):
        if not line.strip():
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
                continue
        try:
            entry = AuditEntry.from_line(line)
        # RecursionError: a line nested too deep for the JSON parser is damage, not a crash.
        except (ValueError, TypeError, KeyError, ValidationError, RecursionError) as exc:
            detail = unreadable_reason(exc)
            report.problems.append(
                ChainProblem(None, "unreadable", None, number, f"not an audit entry: {detail}")
            )
            continue
        key = user_key(entry.user_id)
        if only is None or key == only:
            trails.setdefault(key, []).append((entry.seq, number, entry))
    for key, trail in trails.items():
        for _seq, number, entry in sorted(trail, key=lambda item: (item[0], item[1])):
            _feed_line(checks, key, number, entry, saved, report)
    claimed = (report.export_filters or {}).get("user_id", ANY_USER)
    covered = None if only is not None or claimed is ANY_USER else user_key(claimed)
    _finish_lines(checks, saved, report, covered)
    return report


def read_export_header(line: str) -> dict[str, Any] | None:
    """The filters an export's header line names, or ``None`` if ``line`` is not a header.

    Raises:
        ValueError: a header (it has the header's key) that this loomflow cannot read: another
            format, or filters it does not know. Its scope cannot be trusted.
    """
    try:
        data = json.loads(line)
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
    return filters


def _feed_line(
    checks: dict[str, _ChainCheck],
    key: str,
    number: int,
    entry: AuditEntry,
    saved: Mapping[str, Any],
    report: VerifyReport,
) -> None:
    """Check one line's entry against its user's chain (begun at its first seq)."""
    check = checks.get(key)
    if check is None:
        check = checks[key] = _ChainCheck(key, entry.user_id, saved.get(key, ()))
        report.users += 1
        if entry.seq > 1:
            check.start_at(entry)
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
    report.entries += 1
    check.feed(number, entry, report)


def _finish_lines(
    checks: dict[str, _ChainCheck],
    saved: Mapping[str, Any],
    report: VerifyReport,
    covered: str | None,
) -> None:
    """What can be told only at the end: saved heads reached, erasures recorded.

    ``covered`` is the one user key the export covers (``None``: every user): a user with a
    saved head and no line is reported only if the export covers them.
    """
    for key, user_heads in saved.items():
        found = checks.get(key)
        if found is None and covered is not None and key != covered:
            continue  # the export was not made for this user
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
                    f"records seq {last.seq} and the export does not say it was made for other "
                    "users only",
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
    for check in checks.values():
        check.finish_erasures(report)


def heads_from_json(data: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> list[ChainHead]:
    """Heads from a ``verify --json`` report (its ``heads``) or from a list of such objects.

    Raises:
        InvalidArgumentError: an item lacks ``seq`` or ``hash`` (a ``ValueError``).
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
            heads.append(ChainHead(user_id, int(item["seq"]), str(item["hash"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"not a chain head: {item!r:.200}") from exc
    return heads
