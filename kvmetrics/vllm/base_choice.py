"""The line an engine logs at start saying which vLLM scheduler kvmetrics runs over.

vLLM warns about every custom ``--scheduler-cls``: "If you have subclassed Scheduler
instead of AsyncScheduler, you will see degraded performance due to async scheduling
being disabled". An operator who reads it next to kvmetrics' class name cannot tell
whether it applies. The instrumented scheduler picks its base from vLLM's own decision
(``scheduler_config.async_scheduling``), so the answer depends on the engine; this
line gives it where the warning is read, in the engine's log, once per engine.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from kvmetrics.vllm.exporting import log

#: The part of vLLM's warning an operator greps for, quoted as vLLM writes it.
VLLM_WARNING = ("If you have subclassed Scheduler instead of AsyncScheduler, you will see "
                "degraded performance")


def scheduler_base_line(scheduler: Any) -> str:
    """Which base ``scheduler`` runs over, why, and what vLLM's warning means for it."""
    decided = bool(getattr(getattr(scheduler.vllm_config, "scheduler_config", None),
                           "async_scheduling", False))
    name = type(scheduler).__name__
    if isinstance(scheduler, AsyncScheduler):
        base = "AsyncScheduler"
        why = ("vLLM decided async scheduling for this engine" if decided else
               "the --scheduler-cls class named is an async one, although vLLM decided "
               "against async scheduling for this engine")
        meaning = "does not apply: this class keeps async scheduling"
    else:
        base = "Scheduler"
        why = "vLLM decided against async scheduling for this engine"
        meaning = "does not apply: vLLM runs its own Scheduler here too"
    return (f"kvmetrics: {name} runs over vLLM's {base}: {why} "
            f"(scheduler_config.async_scheduling={decided}); vLLM's warning "
            f"\"{VLLM_WARNING}\" {meaning}")


def log_scheduler_base(scheduler: Any) -> None:
    """Log :func:`scheduler_base_line` at INFO; never raises into vLLM."""
    try:
        log.info("%s", scheduler_base_line(scheduler))
    except Exception:
        log.warning("kvmetrics: could not tell which vLLM scheduler base is in use",
                    exc_info=True)
