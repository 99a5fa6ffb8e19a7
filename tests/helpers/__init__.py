"""Shared test helpers: engine rigs and scenarios, a real Prometheus server, TLS material,
an OTLP/HTTP receiver and readers for exported values.

Import them as ``from tests.helpers.prometheus import running_prometheus``.
"""
