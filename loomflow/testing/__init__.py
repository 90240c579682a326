"""Test helpers that ship with loomflow: a backend conformance suite and fakes."""
