"""Names vulture reports as unused in kvmetrics/ that stay, each with the reason.

vulture reads this file as code that uses the names (``_.name``). Every entry names
who uses it: vLLM, pytest or Python calling it by name, a string lookup vulture
cannot follow, or a read it cannot see. tests/test_dead_code.py checks that each
name still exists in kvmetrics/, so the list cannot outlive its code.
"""
# ruff: noqa: B018, F821

# vLLM's connector factory and config reader call these by name.
_.kv_connector_module_path  # faults.inner_connector.InnerOnly: what vLLM's factory reads
_.get_from_extra_config  # faults.inner_connector.InnerOnly: what vLLM's factory asks a config
_.requires_kv_delivery  # KVConnectorBase_V1 interface (lab.vllm store and canary connectors)
_.save_kv_layer  # KVConnectorBase_V1 interface
_.wait_for_save  # KVConnectorBase_V1 interface
_.kv_layer  # parameter of save_kv_layer, named as vLLM's interface names it
_.attn_metadata  # parameter of save_kv_layer, named as vLLM's interface names it
_.KvmetricsStoreConnector  # lab.vllm: named in --kv-transfer-config, loaded by vLLM's factory

# Python, pytest and the packaging metadata call these by name.
_.__getattr__  # module __getattr__: how vLLM's factory finds FaultInjecting<X> (faults.connector
#   and its alias); the packages' public names, imported on first use (vllm, faults, protect)
_.pytest_configure  # lab.vllm.pytest_cpu_env: a pytest plugin hook
_.pytest_unconfigure  # lab.vllm.pytest_cpu_env: a pytest plugin hook
_.VllmLabEngine  # entry point kvmetrics.lab_engines in pyproject.toml
_.max_size  # exporters.lean_tls: asyncio's SSLProtocol reads its buffer size by this name
_.read_value  # mmap_space.ValueFile: prometheus-client's MmapedValue calls its file class

# Called by name through a string (the recorder's guarded hook calls).
_.set_evict_cause  # helper_hooks: call("kv_cache_manager.evict_blocks", "set_evict_cause")
_.merge_events  # event_hooks: _kv_call_guarded(..., "merge_events", events)

# Read in a way vulture cannot follow.
_.scheduling  # defect_regimes.Severity: read through asdict() in as_dict()
_.regime  # defect_regimes.Severity: read through asdict() in as_dict()
_.offered_blocks  # stall_regime.Retry: a result field, in the repr a failed sweep prints
_.written_tokens  # kv.runner.RunnerStats: compared whole (tests/test_kv_runner.py)

# Counters in exporters/ that are written and never read: exporters/ is being
# restructured in parallel, where each is to be exported or removed.
_.refused  # exporters.admission
_.timed_out  # exporters.http._Stats
_.connections  # exporters.http
_.unavailable  # exporters.multiprocess
