"""The lab's torch KV data plane: real KV blocks, a host store, batched loads, faults, and
the verifier that checks every read of KV against a clean computation. It imports only
itself, the reference engine (:mod:`kvmetrics.lab.engine`) and :mod:`kvmetrics.metrics`.

Importing this package imports torch; code that only needs to recognise the
strict-mode error should use :mod:`kvmetrics.lab.kv_errors` instead.
"""

from kvmetrics.lab.kv.cache import KVCache
from kvmetrics.lab.kv.device import resolve_device, resolve_dtype
from kvmetrics.lab.kv.ground_truth import GroundTruth, PrefixDigestCache
from kvmetrics.lab.kv.runner import RunnerStats, TorchModelRunner
from kvmetrics.lab.kv.store import HostKVStore
from kvmetrics.lab.kv.verify import Finding, KVVerificationError

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
