"""Fixtures shared by the engine, metrics and exporter tests."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvmetrics.exporters.prometheus import PrometheusSink


@pytest.fixture
def prometheus_sink() -> PrometheusSink:
    """A Prometheus sink on a registry of its own (never the global one)."""
    return PrometheusSink(CollectorRegistry())
