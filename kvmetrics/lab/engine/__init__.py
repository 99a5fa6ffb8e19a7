"""The lab's reference engine: a pure-Python model of vLLM v1's scheduler KV path.

Nothing here imports torch, vLLM, an exporter or the rest of the lab (only itself and
:mod:`kvmetrics.metrics`); it only produces step events (:mod:`kvmetrics.metrics.events`)
for the metrics layer to consume.
"""
