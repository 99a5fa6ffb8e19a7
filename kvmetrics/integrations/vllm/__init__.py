"""Deprecated aliases, kept for existing configurations: use :mod:`kvmetrics.vllm` and
:mod:`kvmetrics.faults` instead.

:mod:`.scheduler` and :mod:`.faults` re-export the same class objects as
:mod:`kvmetrics.vllm.scheduler` and :mod:`kvmetrics.faults.connector`; nothing else of
the old package is kept. Nothing is imported here, so that importing it never imports
vLLM.
"""
