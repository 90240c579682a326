"""A journal file that cannot be opened: the error names the file and the likely reason."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from loomflow.errors import StoreUnavailableError
from loomflow.runtime import SqliteRuntime


async def _open(path: Path | str) -> None:
    runtime = SqliteRuntime(path)
    try:
        await runtime.open()
    finally:
        await runtime.close()


async def test_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_text("shopping list\n" * 200)
    with pytest.raises(StoreUnavailableError, match="is not a SQLite database") as caught:
        await _open(path)
    assert str(path) in str(caught.value)
    assert path.read_text().startswith("shopping list")  # left as it was


async def test_a_parent_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StoreUnavailableError, match="is a file, not a directory") as caught:
        await _open(tmp_path / "afile" / "journal.db")
    assert "afile" in str(caught.value)


async def test_a_directory_sqlite_cannot_write(tmp_path: Path) -> None:
    # /proc exists but takes no new files, whoever runs the test (root included).
    with pytest.raises(StoreUnavailableError, match="cannot open or create it") as caught:
        await _open("/proc/loomflow-journal.db")
    assert "/proc/loomflow-journal.db" in str(caught.value)


def test_a_file_this_user_may_not_read() -> None:
    # A journal made by root, opened by the app's user. Root reads any file, so as root the
    # test opens it as nobody, in a directory anyone may write (the hint must not blame it).
    directory = Path(tempfile.mkdtemp(prefix="loomflow-unreadable-"))
    try:
        directory.chmod(0o777)
        path = directory / "journal.db"
        asyncio.run(_open(path))
        path.chmod(0o000)
        as_root = os.geteuid() == 0
        if as_root:
            os.seteuid(65534)
        try:
            with pytest.raises(StoreUnavailableError) as caught:
                asyncio.run(_open(path))
        finally:
            if as_root:
                os.seteuid(0)
        message = str(caught.value)
        assert "the file exists but this user may not read it" in message, message
        assert "directory" not in message, message
        assert not (directory / "journal.db-wal").exists()  # nothing made beside it
    finally:
        shutil.rmtree(directory, ignore_errors=True)
