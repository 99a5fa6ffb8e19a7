"""Deprecated aliases, kept for existing configurations: the old home of the vLLM code.

The code moved to :mod:`kvmetrics.vllm` (the observer), :mod:`kvmetrics.faults` (the
fault-injecting connector), :mod:`kvmetrics.protect` (the opt-in protective recovery) and
:mod:`kvmetrics.lab.vllm` (the lab's harness). Only the two paths that fleets type in
their configurations stay importable here, as aliases of the very same classes:
``kvmetrics.integrations.vllm.scheduler`` (``--scheduler-cls``) and
``kvmetrics.integrations.vllm.faults`` (``kv_connector_module_path``).
"""
