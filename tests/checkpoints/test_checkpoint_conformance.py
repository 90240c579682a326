"""The checkpoint conformance suite, on memory, SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from loomflow.testing.checkpoint_conformance import CheckpointConformance, RuntimeFactory


class TestCheckpointConformance(CheckpointConformance):
    """Every test of the suite, once per backend (the ``runtime_factory`` parameter)."""

    @pytest.fixture
    def make_runtime(self, runtime_factory: RuntimeFactory) -> RuntimeFactory:
        return runtime_factory
