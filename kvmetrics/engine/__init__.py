"""The reference engine: a pure-Python model of vLLM v1's scheduler KV path.

Nothing here imports torch, vLLM or an exporter; it only produces step events
(:mod:`kvmetrics.metrics.events`) for the metrics layer to consume.
"""
