"""A new user's first mistakes with the command line, each case a real process."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import clean_env, loomflow

# Ctrl-C lands while the command groups' modules are imported to build the parser (they are
# loaded on first use, so this is the second or so after the prompt returns on a cold disk).
_CTRL_C_WHILE_THE_PARSER_IS_BUILT = """
import importlib, os, signal, sys
from loomflow.cli import main  # the entry point, taken before its submodule shadows it

cli_main = importlib.import_module("loomflow.cli.main")

load = cli_main._command_modules

def interrupted_load():
    os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode, inside the load
    return load()

cli_main._command_modules = interrupted_load
sys.argv = ["loomflow", "demo"]
main()
"""


def test_ctrl_c_while_the_parser_is_built_exits_130_without_a_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_WHILE_THE_PARSER_IS_BUILT],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 130, done.stderr
    assert done.stdout == ""  # the demo never started


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # nothing listens once it is closed


@pytest.mark.parametrize("where", ["tcp", "unix socket"])
def test_a_postgresql_server_that_is_not_running_is_said_to_be_so(
    where: str, tmp_path: Path
) -> None:
    # Before: "postgres connect failed: ConnectionRefusedError: [Errno 111] Connect call
    # failed ('127.0.0.1', 5999)", or for a socket "FileNotFoundError: [Errno 2] No such file
    # or directory", naming neither the URL nor what to check.
    if where == "tcp":
        url = f"postgresql://app:s3cret@127.0.0.1:{_closed_port()}/app"
        shown = url.replace("s3cret", "***")
    else:
        url = f"postgresql://app:s3cret@/app?host={tmp_path}"  # a directory with no socket in it
        shown = url.replace("s3cret", "***")
    done = loomflow("--url", url, "runs", "list")
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.splitlines()
    assert f"{shown!r}" in line
    assert "no PostgreSQL server accepts connections" in line
    assert "is the server running" in line
    assert "s3cret" not in line


def test_a_missing_ssl_file_is_named_not_taken_for_a_stopped_server(tmp_path: Path) -> None:
    # Before: "postgres connect failed: FileNotFoundError: [Errno 2] No such file or
    # directory", naming no file.
    ca = tmp_path / "ca.pem"
    url = f"postgresql://app@127.0.0.1:{_closed_port()}/app?sslmode=verify-full&sslrootcert={ca}"
    done = loomflow("--url", url, "runs", "list")
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.splitlines()
    assert "no PostgreSQL server" not in line
    assert f"the URL's ?sslrootcert= option names {str(ca)!r}, which does not exist" in line


@pytest.mark.postgres
def test_the_demo_says_the_password_of_its_last_command_is_masked(
    tmp_path: Path, pg_dsn: str
) -> None:
    # Before: the last line named the DSN with `***` for its password and said nothing, so
    # the command copied from it failed authentication on a server that asks for one.
    with_password = pg_dsn.replace("://postgres@", "://postgres:s3cret@", 1)
    assert with_password != pg_dsn
    done = loomflow("demo", "--postgres", with_password, "--workdir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    *_, note, last = done.stdout.splitlines()
    assert last.startswith("Look around: ")  # still the last line
    assert ":***@" in last
    assert "s3cret" not in done.stdout
    assert "***" in note
    assert "PGPASSWORD" in note


def test_the_demo_on_sqlite_has_no_password_note(tmp_path: Path) -> None:
    done = loomflow("demo", "--workdir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "***" not in done.stdout
