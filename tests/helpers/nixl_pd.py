"""NIXL prefill/decode on CPU with two real ``vllm serve`` processes, no proxy.

    prefill, decode = pd_specs(decode_transfer=nixl_transfer(wrapped={"fault_rate": 0.3}))
    servers = VllmServer(prefill, work, "prefill"), VllmServer(decode, work, "decode")
    with started(*servers) as (p, d):
        status, body = pd_complete(p, d, prompt, max_tokens=8)

Both servers use vLLM's ``NixlConnector`` with a CPU transfer buffer; the decode side
may be ``FaultInjectingNixlConnector`` (the wrapper that mirrors NIXL's interfaces,
so the two sides' compatibility hashes agree). The client does what a P/D proxy
does: the prompt goes to prefill with ``max_tokens`` 1 and ``do_remote_decode``, and
the ``kv_transfer_params`` it returns go with the same prompt to decode, which pulls
the KV over NIXL (UCX, loopback). Each side gets its own side-channel port on
127.0.0.1. NIXL needs ``scripts/install-connectors.sh``; a missing install is an error
naming it. Each NIXL worker keeps about one core busy (UCX progress thread): keep
runs to a few prompts.

Two NIXL timings bite on a loaded 2-core machine, and the helpers take both out of
the tests' way (measured in CI: one first handshake timed out, one transfer took 88 s):

- vLLM gives the decode side's handshake a fixed 5 s to get the prefill side's answer;
  a miss fails that request's load (NIXL's own failure, which vLLM and kvmetrics both
  count, and which vLLM does not log as a recovery). ``shake_hands`` sends warm-up
  requests until the handshake has passed, so a test measures after it.
- the prefill side frees a request's KV after ``kv_lease_duration`` (30 s) unless the
  decode side has read it, and a later read then gets "potentially invalid" blocks.
  ``nixl_transfer`` sets the lease to ``LEASE_S`` on both sides.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import free_port
from benchmarks.vllm_server import ServerError, ServerSpec, VllmServer, vllm_cpu_python

#: What the prefill request carries: "keep the KV for a remote decode".
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
HASH_MISMATCH = "compatibility hash mismatch"
HANDSHAKE_PASSED = "NIXL compatibility check passed"
#: NIXL's KV lease in seconds: longer than any transfer a loaded CI machine has taken.
LEASE_S = 600


def require_nixl() -> None:
    probe = subprocess.run([str(vllm_cpu_python()), "-c", "from nixl._api import nixl_agent"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise ServerError(f"NIXL is not installed in the vllm-cpu venv ({last}): run "
                          "`bash scripts/install-connectors.sh`")


def nixl_transfer(policy: str = "recompute", wrapped: dict[str, Any] | None = None) -> dict:
    """``--kv-transfer-config`` of one side; ``wrapped``: the fault settings of a
    ``FaultInjectingNixlConnector`` around it, which hands NIXL its own settings
    through ``inner_extra_config``."""
    nixl_settings = {"kv_lease_duration": LEASE_S}
    config: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                              "kv_buffer_device": "cpu", "kv_load_failure_policy": policy,
                              "kv_connector_extra_config": nixl_settings}
    if wrapped is not None:
        config.update(kv_connector="FaultInjectingNixlConnector",
                      kv_connector_module_path="kvmetrics.faults.connector",
                      kv_connector_extra_config={**wrapped, "inner_extra_config": nixl_settings})
    return config


#: vLLM's CPU backend pins each worker's threads by default (``VLLM_CPU_OMP_THREADS_BIND``
#: ``auto``): in both servers the same way, the main thread to one core and every other
#: thread, NIXL's busy thread included, to the other, where they starve each other and
#: the kernel cannot move them to an idle core (docs/connectors.md, "NIXL on two CPU
#: cores"). Unpinned, one OpenMP thread that sleeps when idle: the kernel places them.
CPU_THREADS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
               "OMP_WAIT_POLICY": "PASSIVE"}


def pd_specs(prefill_transfer: dict | None = None, decode_transfer: dict | None = None,
             **common: Any) -> tuple[ServerSpec, ServerSpec]:
    """Specs of a prefill and a decode server, each with its own NIXL side channel and
    its threads unpinned (:data:`CPU_THREADS`)."""
    specs = []
    for transfer in (prefill_transfer or nixl_transfer(), decode_transfer or nixl_transfer()):
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), **CPU_THREADS}
        specs.append(ServerSpec(kv_transfer=transfer, env=env, **common))
    return specs[0], specs[1]


@contextlib.contextmanager
def started(*servers: VllmServer, timeout: float = 300.0) -> Iterator[tuple[VllmServer, ...]]:
    """Start the servers side by side (start-up is mostly waiting on imports), stop
    them all on the way out, also when one failed to start."""
    require_nixl()
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            for future in [pool.submit(s.start, timeout) for s in servers]:
                future.result()
        yield servers
    finally:
        for server in servers:
            server.stop()


def pd_complete(prefill: VllmServer, decode: VllmServer, prompt: list[int], max_tokens: int,
                timeout: float = 180.0) -> tuple[int, dict[str, Any]]:
    """One request through prefill then decode; (decode's HTTP status, its body)."""
    status, first = prefill.post("/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": REMOTE_DECODE}, timeout=timeout)
    if status != 200:
        raise ServerError(f"prefill answered {status}: {first}")
    params = first.get("kv_transfer_params")
    if not params:
        raise ServerError(f"prefill returned no kv_transfer_params: {first}")
    return decode.post("/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": params},
        timeout=timeout)


def shake_hands(prefill: VllmServer, decode: VllmServer, prompt: list[int],
                attempts: int = 3) -> int:
    """Send ``prompt`` through prefill and decode until the decode side logs that its
    NIXL handshake with the prefill side passed; how many requests that took. Each
    is a load on the decode side (the fault plan counts it) and a finished request."""
    for sent in range(1, attempts + 1):
        status, body = pd_complete(prefill, decode, prompt, max_tokens=1)
        if status != 200:
            raise ServerError(f"decode answered {status} to a warm-up request: {body}")
        if HANDSHAKE_PASSED in decode.log():
            return sent
    raise ServerError(f"no NIXL handshake after {attempts} requests:\n{decode.log_tail()}")
