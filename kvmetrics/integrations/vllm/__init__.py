"""kvmetrics on vLLM 0.33's real v1 scheduler.

- :mod:`.scheduler`: ``InstrumentedScheduler`` / ``InstrumentedAsyncScheduler`` for
  ``vllm serve --scheduler-cls``; they export kvmetrics' counters (:mod:`.exporting`).
- :mod:`.connector`: a KV connector backed by kvmetrics' external store index.
- :mod:`.builder`: vLLM's scheduler built on CPU without a model.
- :mod:`.runner` / :mod:`.engine`: kvmetrics' model runners playing vLLM's worker,
  and ``VllmEngine``, the reference engine's loop surface on vLLM.
- :mod:`.differential`: one workload through both engines.

Nothing is imported here, so that ``import kvmetrics`` never imports vLLM.
"""
