"""Files that hold users' data are created readable by their owner only.

A journal, an audit trail or a user's export holds prompts, model answers and tool results.
Created through the process's umask (022 on most systems) they would be readable by every
local account; created here they start as ``0600`` whatever the umask. A file that already
exists keeps the mode its operator gave it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

from .errors import InvalidArgumentError

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700

# The first bytes of a SQLite database and of its write-ahead log (both byte orders).
_SQLITE_HEADERS = (b"SQLite format 3\x00", b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83")
# The files SQLite keeps beside a database, named after it.
_SQLITE_COMPANIONS = ("-shm", "-wal", "-journal")


def create_private(path: Path) -> None:
    """Create ``path`` empty and owner-only if it does not exist yet (its directory too).

    A directory that cannot be made raises here; a file that cannot be created is left to
    the caller's own open, which reports it in its words (a read-only directory, say).

    A symlink to a file not made yet is followed: the target is created here (SQLite would
    create it through the link with the umask's mode, and not make its directory).
    """
    try:
        path = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: SQLite's open reports it
        return
    # Each directory made is 0700, not only the last one as with mkdir -p; the last call
    # raises for a parent that is a file.
    for directory in reversed([d for d in path.parents if not d.exists()]):
        directory.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    path.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    except OSError:  # FileExistsError included: an existing file keeps its mode
        return
    os.close(fd)


def open_private(path: Path) -> TextIO:
    """``path`` opened for writing UTF-8 text, created owner-only; an existing file is
    truncated and keeps its mode.

    Raises:
        InvalidArgumentError: ``path`` is a SQLite database or its log, or a JSONL audit
            log, which would be lost.
    """
    _refuse_a_database(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    return os.fdopen(fd, "w", encoding="utf-8")


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as :func:`open_private` opens it."""
    with open_private(path) as fh:
        fh.write(text)


def _head(path: Path) -> bytes:
    """The first 16 bytes of ``path``; none when it cannot be read (the open for writing
    reports that in its own words)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(16)
    except OSError:
        return b""


def _refuse_a_database(path: Path) -> None:
    """An export is never written over a SQLite file: ``-o journal.db`` would destroy the
    journal, and the command reading it would then export the emptied file. A symlink is
    judged by its target too: a link to ``journal.db-shm`` names no database itself."""
    try:
        target = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: the open reports it
        target = path
    if target != path.absolute():
        _refuse_one(target)  # first: its error names the file the link leads to
    _refuse_one(path)


def _refuse_one(path: Path) -> None:
    if not path.is_file():  # missing, a directory, a pipe or a device: not read here
        return
    for suffix in _SQLITE_COMPANIONS:
        database = path.with_name(path.name.removesuffix(suffix))
        if path.name.endswith(suffix) and _head(database).startswith(_SQLITE_HEADERS[0]):
            # The -shm has no header of its own; truncating it under a process that maps it
            # kills that process (SIGBUS).
            raise InvalidArgumentError(
                f"{str(path)!r} is the {suffix[1:]} file of the SQLite database "
                f"{str(database)!r}, which an export would overwrite (and crash every process "
                "that has the database open): name a new file"
            )
    if _head(path).startswith(_SQLITE_HEADERS):
        raise InvalidArgumentError(
            f"{str(path)!r} is a SQLite database (a journal or another store), which an "
            "export would overwrite: name a new file"
        )
    if _is_jsonl_log(path):
        raise InvalidArgumentError(
            f"{str(path)!r} is a JSONL audit log (its .heads file is beside it), which an "
            "export would overwrite: name a new file"
        )
    # The files kept beside such a log: without its heads, every later append is refused.
    for suffix in (".heads", ".lock"):
        stem = path.name.removesuffix(suffix)
        if stem in ("", path.name):
            continue
        log = path.with_name(stem)
        if log.is_file() and _is_jsonl_log(log):
            raise InvalidArgumentError(
                f"{str(path)!r} is the {suffix} file of the JSONL audit log {str(log)!r}, "
                "which an export would overwrite: name a new file"
            )


def _is_jsonl_log(log: Path) -> bool:
    """Whether ``log`` is a JSONL audit log: its ``.heads`` file is beside it."""
    return log.with_name(log.name + ".heads").exists()
