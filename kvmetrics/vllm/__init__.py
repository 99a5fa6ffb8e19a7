"""The observer: what ships into ``vllm serve``, kvmetrics inside vLLM's EngineCore.

``vllm serve --scheduler-cls kvmetrics.vllm.scheduler.InstrumentedScheduler`` loads this
package into a production vLLM process. It counts and never changes a decision of vLLM's;
the opt-in protective recovery (:mod:`kvmetrics.protect`) is composed into the class only
when asked for. It may import the engine-agnostic core (:mod:`kvmetrics.metrics`), the
exporters, vLLM and, from :mod:`.scheduler` only, :mod:`kvmetrics.protect`; never the
fault connector (:mod:`kvmetrics.faults`), the lab or the commands.

- :mod:`.scheduler`: ``InstrumentedScheduler`` (over vLLM's ``AsyncScheduler`` when vLLM
  decided async scheduling); it exports kvmetrics' counters (:mod:`.exporting`) from what
  :mod:`.recorder` sees through the hooked vLLM methods of :mod:`.hooks`,
  :mod:`.helper_hooks` and :mod:`.event_hooks`.
- :mod:`.step_end`, :mod:`.selfcheck`, :mod:`.recovery_check`, :mod:`.owncost`: the end
  of a step, the cross-checks with vLLM's own figures, kvmetrics' own CPU time.
- :mod:`.fingerprints`, :mod:`.source_hashes`, ``verified_vllm.json``: which vLLM code
  kvmetrics was verified on.

The names in ``__all__`` are imported on first use, so that importing this package (or
``kvmetrics``) never imports vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["InstrumentedAsyncScheduler", "InstrumentedScheduler"]


def __getattr__(name: str) -> Any:
    """The schedulers of ``__all__``, from :mod:`.scheduler` (which imports vLLM)."""
    if name in __all__:
        from kvmetrics.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
