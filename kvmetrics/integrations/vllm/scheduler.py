"""Deprecated alias, kept for existing configurations: use
``--scheduler-cls kvmetrics.vllm.scheduler.InstrumentedScheduler``.

``--scheduler-cls kvmetrics.integrations.vllm.scheduler.InstrumentedScheduler`` (and
``...InstrumentedAsyncScheduler``) keep working: these are the very same classes as
:mod:`kvmetrics.vllm.scheduler`'s, not copies.
"""

from kvmetrics.vllm.scheduler import InstrumentedAsyncScheduler, InstrumentedScheduler

__all__ = ["InstrumentedAsyncScheduler", "InstrumentedScheduler"]
