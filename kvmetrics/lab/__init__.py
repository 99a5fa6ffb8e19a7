"""The lab: ``kvmetrics run``, soaks, the report and the vLLM canaries; never in a server.

Nothing here is imported by ``vllm serve``: the lab drives engines of its own (or vLLM's
scheduler in-process, without a model) and verifies every read of KV. Its modules build
on the shipped packages (:mod:`kvmetrics.metrics`, :mod:`kvmetrics.exporters`); its
subpackages, each a layer of its own (tests/test_layers.py):

- :mod:`.engine`: the reference engine, a pure-Python model of vLLM v1's scheduler KV
  path (imports only itself and :mod:`kvmetrics.metrics`).
- :mod:`.kv`: the torch data plane and its verifier (itself, :mod:`.engine`, metrics).
- :mod:`.vllm`: the harness around vLLM's real scheduler, the defect canaries and the
  mutation campaign; registered through the ``kvmetrics.lab_engines`` entry point
  (:mod:`.engine_registry`), so the rest of the lab never imports it.
- :mod:`.instrument`: the reference engine plus metrics; :mod:`.kv_errors`: the data
  plane's strict stop, recognised without importing torch.
"""
