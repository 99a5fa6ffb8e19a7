"""The torch KV data plane: real KV blocks, a host store, batched loads, faults, and the
verifier that checks every read of KV against a clean computation.

Importing this package imports torch; code that only needs to recognise the
strict-mode error should use :mod:`kvmetrics.kv_errors` instead.
"""

from kvmetrics.kv.cache import KVCache
from kvmetrics.kv.device import resolve_device, resolve_dtype
from kvmetrics.kv.ground_truth import GroundTruth, PrefixDigestCache
from kvmetrics.kv.runner import RunnerStats, TorchModelRunner
from kvmetrics.kv.store import HostKVStore
from kvmetrics.kv.verify import Finding, KVVerificationError

__all__ = [
    "Finding",
    "GroundTruth",
    "HostKVStore",
    "KVCache",
    "KVVerificationError",
    "PrefixDigestCache",
    "RunnerStats",
    "TorchModelRunner",
    "resolve_device",
    "resolve_dtype",
]
