"""The lab's harness around vLLM's real scheduler: runs in ``kvmetrics``, never in a server.

vLLM's v1 scheduler is driven in-process on a CPU-only machine, without a model, with
the lab's data plane playing vLLM's worker, so the verifier checks vLLM's own recovery
path. It may import the rest of the lab (the data plane, the reference engine) and what
ships into ``vllm serve`` (:mod:`kvmetrics.vllm`, :mod:`kvmetrics.faults`,
:mod:`kvmetrics.protect`); nothing that ships imports it.

- :mod:`.builder`: vLLM's scheduler built on CPU without a model or weights.
- :mod:`.runner` / :mod:`.engine`: kvmetrics' model runners playing vLLM's worker, and
  ``VllmEngine``, the reference engine's loop surface on vLLM.
- :mod:`.store_connector`: a KV connector backed by the lab's external store index
  (loadable with ``kv_connector_module_path``; it offers nothing in a real server).
- :mod:`.lab`: ``--engine vllm``, registered through the ``kvmetrics.lab_engines``
  entry point.
- :mod:`.differential`: one workload through both engines.
- :mod:`.canaries`: the recovery-path defects as minimal scenarios (``vllm-check``),
  on :mod:`.canary_bench` (vLLM's scheduler, a scripted connector, a played worker);
  :mod:`.defect_regimes` says when each bites, :mod:`.stall_regime` sweeps the stall.

Nothing is imported here, so that ``import kvmetrics`` never imports vLLM.
"""
