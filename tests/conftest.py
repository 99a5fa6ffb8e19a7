"""Fixtures shared by the engine, metrics and exporter tests."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings
from prometheus_client import CollectorRegistry

from kvmetrics.exporters.prometheus import PrometheusSink


@pytest.fixture
def prometheus_sink() -> PrometheusSink:
    """A Prometheus sink on a registry of its own (never the global one)."""
    return PrometheusSink(CollectorRegistry())


# CI runs the property tests on a fixed set of examples, so a green run stays
# green; locally each run explores new examples (and remembers failures).
settings.register_profile("ci", derandomize=True, database=None, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
