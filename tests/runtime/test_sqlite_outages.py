"""A SQLite journal on a filesystem that fills up or turns read-only.

sqlite3 says "database or disk is full", "disk I/O error" or "unable to open database file",
naming neither the file nor the filesystem; a disk that filled up reads like a broken one,
and a filesystem remounted read-only (what the kernel does after an I/O error) like a
directory's permissions. The tests mount a small tmpfs of their own, so they run as root only.
"""

from __future__ import annotations

import errno
import os
import resource
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from loomflow.errors import StoreUnavailableError
from loomflow.runtime import SqliteRuntime


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted after the test."""
    where = tmp_path / "small"
    where.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _remount_read_only(where: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)


def _fill(where: Path) -> Path:
    """Write a file until the filesystem is full; return it (delete it to free the space)."""
    filler = where / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError, match="No space left") as caught:
            while os.write(fd, b"\0" * 4096):
                pass
    finally:
        os.close(fd)
    assert caught.value.errno == errno.ENOSPC
    return filler


async def _body(i: int) -> dict[str, object]:
    return {"i": i, "pad": "x" * 2000}


async def _steps(path: Path, count: int) -> list[str]:
    """Run ``count`` steps of one run; the names of those replayed from the journal."""
    runtime = SqliteRuntime(path)
    try:
        async with runtime.session("s", "u") as run:
            for i in range(count):
                await runtime.step(f"step-{i}", _body, i)
        return list(run.stats.hit_steps)
    finally:
        await runtime.close()


async def test_a_full_disk_is_named_and_the_run_resumes_after(small_fs: Path) -> None:
    path = small_fs / "journal.db"
    runtime = SqliteRuntime(path)
    try:
        with pytest.raises(StoreUnavailableError) as caught:
            async with runtime.session("s", "u"):
                for i in range(3):
                    await runtime.step(f"step-{i}", _body, i)
                filler = _fill(small_fs)
                for i in range(3, 400):
                    await runtime.step(f"step-{i}", _body, i)
    finally:
        await runtime.close()
    message = str(caught.value)
    assert "is full" in message, message
    assert str(small_fs) in message, message
    filler.unlink()
    replayed = await _steps(path, 5)
    assert replayed[:3] == ["step-0", "step-1", "step-2"]  # nothing journaled was lost


async def test_opening_a_journal_on_a_full_disk_names_it(small_fs: Path) -> None:
    path = small_fs / "journal.db"
    await _steps(path, 2)  # closed: its -wal and -shm are gone, and must be made again
    _fill(small_fs)
    with pytest.raises(StoreUnavailableError) as caught:
        await _steps(path, 2)
    assert "is full" in str(caught.value), str(caught.value)


async def test_a_read_only_filesystem_is_named(small_fs: Path) -> None:
    path = small_fs / "journal.db"
    await _steps(path, 2)
    _remount_read_only(small_fs)
    with pytest.raises(StoreUnavailableError) as caught:
        await _steps(path, 2)
    message = str(caught.value)
    assert "mounted read-only" in message, message
    assert "writable by this user" not in message, message


async def test_a_file_size_limit_is_named_not_called_a_disk_error(tmp_path: Path) -> None:
    # `ulimit -f` (systemd's LimitFSIZE=) on a disk with room: the write fails with EFBIG,
    # which sqlite3 calls "disk I/O error", naming neither the file nor the limit.
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        with pytest.raises(StoreUnavailableError) as caught:
            async with runtime.session("s", "u"):
                for i in range(3):
                    await runtime.step(f"step-{i}", _body, i)
                # Python ignores SIGXFSZ, so a write beyond the limit fails with EFBIG.
                resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 200_000, hard))
                for i in range(3, 400):
                    await runtime.step(f"step-{i}", _body, i)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        await runtime.close()
    message = str(caught.value)
    assert "file size limit" in message, message
    assert "ulimit -f" in message, message
    replayed = await _steps(path, 5)
    assert replayed[:3] == ["step-0", "step-1", "step-2"]  # nothing journaled was lost
