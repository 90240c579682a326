"""A LOOMFLOW_* variable that names no setting is reported by the library, not only by
`loomflow settings`: a service built with Agent.from_settings() logs it once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from loomflow import config
from loomflow.config import Settings


@pytest.fixture(autouse=True)
def fresh_report(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "_reported", set())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "loomflow.config"]


def test_a_misspelled_variable_is_logged_once_with_the_setting_it_meant(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LOOMFLOW_LEASE_SECOND", "5")
    with caplog.at_level(logging.WARNING, logger="loomflow"):
        settings = Settings()
        Settings()  # built again by every store: still one line
    assert settings.lease_seconds == 30.0  # the typo really was ignored
    assert _warnings(caplog) == [
        "LOOMFLOW_LEASE_SECOND is not a setting and is ignored "
        "(did you mean LOOMFLOW_LEASE_SECONDS?)"
    ]


def test_a_misspelled_variable_in_the_env_file_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    env = tmp_path / "service.env"
    env.write_text("LOOMFLOW_AUDTI_URL=sqlite:///audit.db\nOTHER=1\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="loomflow"):
        Settings(_env_file=env)  # type: ignore[call-arg]
    assert _warnings(caplog) == [
        f"LOOMFLOW_AUDTI_URL in {env} is not a setting and is ignored "
        "(did you mean LOOMFLOW_AUDIT_URL?)"
    ]


def test_settings_and_other_variables_are_not_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LOOMFLOW_LEASE_SECONDS", "5")
    monkeypatch.setenv("loomflow_max_payload_bytes", "1000")  # read case-blind
    monkeypatch.setenv("LOOMFLOW_TEST_PG_DSN", "postgresql://x@y/z")  # the suite's own
    monkeypatch.setenv("LOOMFLOWER", "1")  # another prefix altogether
    with caplog.at_level(logging.WARNING, logger="loomflow"):
        Settings()
    assert _warnings(caplog) == []


def test_every_command_line_command_warns_not_only_settings(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "cli"))
    from _cli import clean_env, loomflow

    url = f"sqlite:///{tmp_path / 'journal.db'}"
    done = loomflow("--url", url, "migrate", env=clean_env(LOOMFLOW_LEASE_SECOND="5"))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("LOOMFLOW_LEASE_SECOND is not a setting") == 1, done.stderr
    assert "did you mean LOOMFLOW_LEASE_SECONDS?" in done.stderr


def test_a_misspelled_variable_is_reported_also_when_another_value_is_bad(
    tmp_path: Path,
) -> None:
    # The bad value stops the command; the typo beside it must not wait for the next try
    # (a user who fixes the one error would then meet a second surprise).
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "cli"))
    from _cli import clean_env, loomflow

    env = clean_env(LOOMFLOW_RUNTIM_URL="sqlite:///journal.db", LOOMFLOW_LEASE_SECONDS="soon")
    done = loomflow("runs", "list", env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        "loomflow: warning: LOOMFLOW_RUNTIM_URL is not a setting and is ignored "
        "(did you mean LOOMFLOW_RUNTIME_URL?)",
        "loomflow: error: bad setting LOOMFLOW_LEASE_SECONDS: Input should be a valid number, "
        "unable to parse string as a number",
    ]


def test_a_keyword_in_code_that_names_no_setting_is_refused() -> None:
    from loomflow.errors import ConfigurationError

    # Before: extra="ignore" dropped it, and the service ran on the default 30 s lease.
    with pytest.raises(ConfigurationError, match=r"'lease_second' \(did you mean lease_seconds"):
        Settings(lease_second=5)
    with pytest.raises(ConfigurationError, match="as lease_seconds=, not by its variable"):
        Settings(LOOMFLOW_LEASE_SECONDS=5)
    assert Settings(lease_seconds=5, _env_file=None).lease_seconds == 5


@pytest.mark.parametrize("guess", ["LOOMFLOW_URL", "LOOMFLOW_DATABASE_URL", "LOOMFLOW_DSN"])
def test_a_guessed_name_for_the_journal_points_to_the_runtime_url(
    guess: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The command line's flag is --url, so LOOMFLOW_URL is a new user's first guess; no
    # spelling distance finds LOOMFLOW_RUNTIME_URL from it.
    monkeypatch.setenv(guess, "postgresql://app@db/app")
    with caplog.at_level(logging.WARNING, logger="loomflow"):
        settings = Settings()
    assert settings.runtime_url == "sqlite:///.loomflow/journal.db"
    assert _warnings(caplog) == [
        f"{guess} is not a setting and is ignored (did you mean LOOMFLOW_RUNTIME_URL?)"
    ]
