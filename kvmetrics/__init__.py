"""kvmetrics: observability for KV-cache load failures and recovery in LLM serving."""

__version__ = "0.1.0"
