"""The demo's requests, and what to read afterwards (docs/demo.md).

Sends one prompt twice to the server of ``scripts/demo-vllm-serve.sh``, with the prefix
cache reset between, so that the second time its blocks come through the connector;
the demo fails the server's first load on purpose. Then prints the kvmetrics series
that show the recovery, and vLLM's own account of it from the server's log, side by side.

    .venv/bin/python scripts/demo_requests.py     # PORT, METRICS_PORT, SERVE_LOG as the server

Standard library only. Exit status: 0 when the failure was injected and kvmetrics'
counts equal vLLM's log, 1 when they differ or nothing failed, 2 when the server is
not there.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORT = int(os.environ.get("PORT", "8000"))
METRICS_PORT = int(os.environ.get("METRICS_PORT", "9401"))
SERVE_LOG = Path(os.environ.get("SERVE_LOG", ROOT / "demo-vllm-serve.log"))
PROMPT = list(range(10, 140))  # token ids: the demo model has no tokenizer

RECOVERED = re.compile(r"Recovered from KV load failure: (\d+) request\(s\) rescheduled "
                       r"\((\d+) tokens affected\)")
INJECTED = re.compile(r"failing load #\d+ of request \S+ \(\w+\): blocks \[[\d, ]*\]")
SAMPLE = re.compile(r"^(kvmetrics_[a-z_]+)(\{[^}]*\})? (\S+)$")
#: The series to look at, in the order a reader follows the recovery.
SHOWN = ("kvmetrics_kv_load_blocks_total", "kvmetrics_kv_load_failed_requests_total",
         "kvmetrics_rolled_back_tokens_total", "kvmetrics_recomputed_tokens_total")


def _call(path: str, port: int, body: bytes | None = None) -> str:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"} if body else {})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read().decode()


def _samples(page: str) -> list[tuple[str, str, float]]:
    found = []
    for line in page.splitlines():
        match = SAMPLE.match(line)
        if match and match[1] in SHOWN:
            found.append((match[1], match[2] or "", float(match[3])))
    return found


def _total(samples: list[tuple[str, str, float]], name: str, label: str = "") -> float:
    return sum(v for n, labels, v in samples if n == name and label in labels)


def _vllm_recovery() -> tuple[int, int, list[str]]:
    text = SERVE_LOG.read_text(encoding="utf-8", errors="replace") if SERVE_LOG.is_file() else ""
    lines = RECOVERED.findall(text)
    return (sum(int(n) for n, _ in lines), sum(int(t) for _, t in lines),
            INJECTED.findall(text))


def main() -> int:
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 8,
                       "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    try:
        first = json.loads(_call("/v1/completions", PORT, body))["choices"][0]["token_ids"]
        _call("/reset_prefix_cache", PORT, b"")
        second = json.loads(_call("/v1/completions", PORT, body))["choices"][0]["token_ids"]
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        print(f"demo_requests: no demo server on 127.0.0.1:{PORT} ({e}); start it with "
              "bash scripts/demo-vllm-serve.sh", file=sys.stderr)
        return 2
    print(f"request 1, 130 prompt tokens computed:       output token ids {first}")
    print(f"request 2, the same after /reset_prefix_cache: output token ids {second}")
    print("  its KV came through the connector, failed blocks recomputed: "
          + ("same output" if first == second else "OUTPUT DIFFERS"))
    # The EngineCore updates the page after the step that finished the request.
    deadline = time.monotonic() + 20
    while True:
        samples = _samples(_call("/metrics", METRICS_PORT))
        requests, tokens, injected = _vllm_recovery()
        failed_requests = _total(samples, "kvmetrics_kv_load_failed_requests_total")
        if (failed_requests >= requests > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"\nkvmetrics, http://127.0.0.1:{METRICS_PORT}/metrics (non-zero series):")
    for name, labels, value in samples:
        if value:
            print(f"  {name}{labels} {value:g}")
    print(f"\nvLLM, its own log ({SERVE_LOG.name}):")
    for line in injected:
        print(f"  kvmetrics fault connector: {line}")
    print(f"  'Recovered from KV load failure' lines: {requests} request(s) rescheduled, "
          f"{tokens} tokens affected")
    ours_requests = failed_requests
    ours_tokens = _total(samples, "kvmetrics_rolled_back_tokens_total")
    failed_blocks = _total(samples, "kvmetrics_kv_load_blocks_total", 'outcome="failed"')
    same = (ours_requests, ours_tokens) == (requests, tokens)
    print(f"\nfailed blocks {failed_blocks:g}; failed requests: kvmetrics {ours_requests:g}, "
          f"vLLM {requests}; rolled-back tokens: kvmetrics {ours_tokens:g}, vLLM {tokens}: "
          + ("equal" if same else "DIFFERENT"))
    return 0 if same and failed_blocks > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
