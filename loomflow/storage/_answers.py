"""Checking a store's yes/no answers.

Stores may be third-party (any object that follows a store protocol). Where a True/False
answer decides what happens next (a run dead-lettered, a hold still held, a turn still
ours), a broken store's ``None`` must not pass for ``False``: the caller would go on as if
nothing had happened (running a step twice, letting a hold lapse, skipping an audit entry).
"""

from __future__ import annotations

from ..errors import StorageError


def yes_or_no(answer: object, store: object, kind: str, method: str, unknown: str) -> bool:
    """``answer`` when it is a bool, else :class:`StorageError` saying what is now unknown.

    ``kind`` names the store ("journal"), ``method`` the protocol method that answered, and
    ``unknown`` completes "it is unknown whether ...".
    """
    if isinstance(answer, bool):
        return answer
    protocol = kind.title().replace(" ", "") + "Store"
    raise StorageError(
        f"the {kind} store {type(store).__name__} answered {method}() with a "
        f"{type(answer).__name__}, not True or False, so it is unknown whether {unknown} "
        f"({protocol}.{method} must say)"
    )
