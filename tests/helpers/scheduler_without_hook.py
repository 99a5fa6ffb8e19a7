"""A scheduler for ``--scheduler-cls`` in a real server whose vLLM lacks one hooked method.

Importing this module (vLLM does, in the EngineCore process, to resolve the class)
removes ``Scheduler._handle_failed_recving`` while vLLM's connector output still has
``failed_recving``: a vLLM kvmetrics cannot fully instrument. Only for servers without
a connector that fails whole requests (nothing then calls the method). The test reads
the server's log for kvmetrics' one-line warning and the endpoint for the families.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from kvmetrics.vllm.scheduler import InstrumentedScheduler

if "_handle_failed_recving" in vars(Scheduler):
    del Scheduler._handle_failed_recving


class SchedulerWithoutHook(InstrumentedScheduler):
    """The instrumented scheduler, on the vLLM this module left without the method."""
