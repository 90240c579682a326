"""The journal conformance suite, run against every backend."""

from __future__ import annotations

import pytest

from loomflow.testing.conformance import JournalConformance, RuntimeFactory


class TestJournalConformance(JournalConformance):
    """Every test of the suite, once per backend (the ``runtime_factory`` parameter)."""

    @pytest.fixture
    def make_runtime(self, runtime_factory: RuntimeFactory) -> RuntimeFactory:
        return runtime_factory
