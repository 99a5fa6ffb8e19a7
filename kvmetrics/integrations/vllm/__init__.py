"""What ships into a real ``vllm serve``: kvmetrics inside vLLM's EngineCore.

Everything in this folder may be loaded by a production vLLM process, so it imports
only the engine-agnostic core (``kvmetrics.metrics``, ``kvmetrics.exporters``) and
vLLM, never the lab, the data plane or :mod:`kvmetrics.integrations.vllm_lab`.

- :mod:`.scheduler`: ``InstrumentedScheduler`` for ``vllm serve --scheduler-cls``; it
  exports kvmetrics' counters (:mod:`.exporting`) from what :mod:`.recorder` sees
  through the hooked vLLM methods of :mod:`.hooks` and :mod:`.helper_hooks`.
- :mod:`.protect`: the opt-in protective recovery (``KVMETRICS_RECOVERY=evict``).
- :mod:`.faults`: ``FaultInjectingConnector``, a connector that wraps a real one and
  fails a chosen share of its loads (settings and plan in :mod:`.fault_plan`).

The lab's harness around vLLM's scheduler (no model, CPU only) lives in
:mod:`kvmetrics.integrations.vllm_lab`.

Nothing is imported here, so that ``import kvmetrics`` never imports vLLM.
"""
