"""A store URL that does not parse never shows its password, however it is spelled."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loomflow.config import Settings, _masked_url
from loomflow.errors import ConfigurationError

SECRET = "s3cr3t-pw"

# Malformed on purpose (a bad port or scheme), with the password spelled the ways people do:
# unescaped "@", "/", "?" or "#" inside it, or in the query string.
BAD_URLS = [
    f"postgresql://app:{SECRET}@db:notaport/app",
    f"postgresql://app:{SECRET[:4]}@{SECRET[4:]}@db:notaport/app",
    f"postgresql://app:{SECRET[:4]}/{SECRET[4:]}@db:notaport/app",
    f"postgresql://app:{SECRET[:4]}?{SECRET[4:]}@db:notaport/app",
    f"postgresql://app:{SECRET[:4]}#{SECRET[4:]}@db:notaport/app",
    f"postgresql://app@db:notaport/app?password={SECRET}",
    f"sqlite://app:{SECRET}@db/journal.db",
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_settings_error_shows_neither_the_password_nor_a_part_of_it(
    url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.chdir(str(tmp_path))
    monkeypatch.setenv("LOOMFLOW_RUNTIME_URL", url)
    with pytest.raises(ConfigurationError) as caught:
        Settings()
    text = str(caught.value) + repr(caught.value)
    assert "LOOMFLOW_RUNTIME_URL" in text
    for part in (SECRET, SECRET[:4], SECRET[4:]):
        assert part not in text, text


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:a@b/c@db:5432/app", "postgresql://app:***@db:5432/app"),
        ("postgresql://app:a?b#c@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app@db/app?password=x&sslmode=require", "?password=***&sslmode=require"),
        ("postgresql://db:5432/app", "postgresql://db:5432/app"),
    ],
)
def test_masking_hides_the_whole_password(url: str, shown: str) -> None:
    assert shown in _masked_url(url)


def test_the_cli_names_a_bad_url_without_its_password(tmp_path: object) -> None:
    url = f"postgresql://app:{SECRET[:4]}/{SECRET[4:]}@db:notaport/app"
    done = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", url, "runs", "list"],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("loomflow: error:"), done.stderr
    assert "Traceback" not in done.stderr
    for part in (SECRET, SECRET[:4], SECRET[4:]):
        assert part not in done.stderr + done.stdout
