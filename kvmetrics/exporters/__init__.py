"""Exporters: turn guarded metric updates into Prometheus pages and OTLP streams."""
