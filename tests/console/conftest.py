"""Fixtures of the console tests: one deployment and one console server per session."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from console_helpers import Deployment, Server, build

from loomflow.config import Settings
from loomflow.console import ConsoleOptions


@pytest.fixture(scope="session")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    return asyncio.run(build(tmp_path_factory.mktemp("console")))


@pytest.fixture(scope="session")
def console(deployment: Deployment) -> Iterator[Server]:
    settings = Settings(runtime_url=deployment.url, redact_secrets=["s3cr3t-value-xyz"])
    with Server(settings, ConsoleOptions(tokens_file=deployment.tokens)) as server:
        yield server
