"""The demo's requests, and what to read afterwards (docs/demo.md).

Sends one prompt twice to the server of ``scripts/demo-vllm-serve.sh``, with the prefix
cache reset between, so that the second time its blocks come through the connector;
the demo fails the server's first load on purpose. Then prints the kvmetrics series
that show the recovery, and vLLM's own account of it from the server's log, side by side.

    .venv/bin/python scripts/demo_requests.py     # PORT, METRICS_PORT, SERVE_LOG as the server

The page must be the server's own, and its numbers current:

- the server's log must say that kvmetrics serves on ``127.0.0.1:METRICS_PORT`` (the
  engine logs that line only once the port is bound; a server that could not bind it
  logs "cannot serve metrics on" instead, and another process's page is there);
- the page must count this script's two requests (``kvmetrics_finished_requests_total``
  two higher than before them): a page that does not is another server's;
- the page is collected at most once a second and served from memory in between, so it
  is read until two reads more than a second apart agree.

Standard library only. Exit status: 0 when the failure was injected and kvmetrics'
counts equal vLLM's log, 1 when they differ, nothing failed, or the page is not this
server's (one line saying why), 2 when the server is not there.
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
REQUESTS = 2
#: How long the page may take to count the requests once they are answered.
COUNT_WAIT_S = 10.0
#: Longer than the endpoint keeps a collected page (KVMETRICS_SCRAPE_MAX_AGE_S, 1 s).
PAGE_AGE_S = 1.2

RECOVERED = re.compile(r"Recovered from KV load failure: (\d+) request\(s\) rescheduled "
                       r"\((\d+) tokens affected\)")
#: The fault connector's line, as it writes it (kvmetrics/faults/connector.py).
INJECTED = re.compile(r"FaultInjectingConnector: failing load #\d+ of request \S+ \(\w+\): "
                      r"blocks \[[\d, ]*\]")
BOUND = re.compile(r"kvmetrics: serving metrics on https?://([^/\s]+)/metrics")
NOT_BOUND = re.compile(r"kvmetrics: cannot serve metrics on (\S+): ([^;]*);")
SAMPLE = re.compile(r"^(kvmetrics_[a-z_]+)(\{[^}]*\})? (\S+)$")
FINISHED = "kvmetrics_finished_requests_total"
#: The series to look at, in the order a reader follows the recovery.
SHOWN = ("kvmetrics_kv_load_blocks_total", "kvmetrics_kv_load_failed_requests_total",
         "kvmetrics_rolled_back_tokens_total", "kvmetrics_recomputed_tokens_total")

Samples = list[tuple[str, str, float]]


class PageRefused(Exception):
    """The page on METRICS_PORT is not this server's, or has no settled numbers (one
    line why)."""


def _call(path: str, port: int, body: bytes | None = None) -> str:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"} if body else {})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read().decode()


def _samples(page: str) -> Samples:
    found = []
    for line in page.splitlines():
        match = SAMPLE.match(line)
        if match and match[1] in (*SHOWN, FINISHED):
            found.append((match[1], match[2] or "", float(match[3])))
    return found


def _total(samples: Samples, name: str, label: str = "") -> float:
    return sum(v for n, labels, v in samples if n == name and label in labels)


def _log_text() -> str:
    return SERVE_LOG.read_text(encoding="utf-8", errors="replace") if SERVE_LOG.is_file() else ""


def _check_log_claims_the_page() -> None:
    """The server's log must say that its engine bound ``127.0.0.1:METRICS_PORT``."""
    address = f"127.0.0.1:{METRICS_PORT}"
    text = _log_text()
    for where, why in NOT_BOUND.findall(text):
        if where == address:
            raise PageRefused(
                f"the server's log ({SERVE_LOG}) says kvmetrics could not bind {address} "
                f"({why}): the page there is another process's; give each demo server "
                "its own PORT, METRICS_PORT and SERVE_LOG")
    if address not in BOUND.findall(text):
        raise PageRefused(
            f"the server's log ({SERVE_LOG}) does not say that kvmetrics serves on {address}; "
            "run this script with the PORT, METRICS_PORT and SERVE_LOG of the server")


def _fresh_page(finished_before: float) -> Samples:
    """The page once it counts this script's requests and two reads more than
    ``PAGE_AGE_S`` apart agree (the endpoint serves a page up to a second old)."""
    deadline = time.monotonic() + COUNT_WAIT_S
    previous: Samples | None = None
    while True:
        samples = _samples(_call("/metrics", METRICS_PORT))
        counted = _total(samples, FINISHED) - finished_before
        if counted >= REQUESTS and samples == previous:
            return samples
        if time.monotonic() > deadline and counted >= REQUESTS:
            raise PageRefused(
                f"the page on 127.0.0.1:{METRICS_PORT} kept changing for {COUNT_WAIT_S:g} s "
                "(other requests to this server?): no settled numbers to compare")
        if time.monotonic() > deadline:
            raise PageRefused(
                f"the page on 127.0.0.1:{METRICS_PORT} counted {counted:g} of this script's "
                f"{REQUESTS} requests to 127.0.0.1:{PORT} in {COUNT_WAIT_S:g} s: it is not "
                "that server's page (another demo server on METRICS_PORT?)")
        previous = samples if counted >= REQUESTS else None
        time.sleep(PAGE_AGE_S)


def _vllm_recovery(text: str) -> tuple[int, int, list[str]]:
    lines = RECOVERED.findall(text)
    return (sum(int(n) for n, _ in lines), sum(int(t) for _, t in lines),
            INJECTED.findall(text))


def main() -> int:
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 8,
                       "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    try:
        before = _total(_samples(_call("/metrics", METRICS_PORT)), FINISHED)
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"demo_requests: no kvmetrics page on 127.0.0.1:{METRICS_PORT} ({e}); start "
              "the server with bash scripts/demo-vllm-serve.sh", file=sys.stderr)
        return 2
    try:
        _check_log_claims_the_page()
    except PageRefused as e:
        print(f"demo_requests: {e}", file=sys.stderr)
        return 1
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
    try:
        samples = _fresh_page(before)
    except PageRefused as e:
        print(f"demo_requests: {e}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"demo_requests: the page on 127.0.0.1:{METRICS_PORT} went away ({e})",
              file=sys.stderr)
        return 2
    requests, tokens, injected = _vllm_recovery(_log_text())
    print(f"\nkvmetrics, http://127.0.0.1:{METRICS_PORT}/metrics (non-zero series):")
    for name, labels, value in samples:
        if value and name in SHOWN:
            print(f"  {name}{labels} {value:g}")
    print(f"\nvLLM, its own log ({SERVE_LOG.name}):")
    for line in injected:
        print(f"  {line}")
    print(f"  'Recovered from KV load failure' lines: {requests} request(s) rescheduled, "
          f"{tokens} tokens affected")
    ours_requests = _total(samples, "kvmetrics_kv_load_failed_requests_total")
    ours_tokens = _total(samples, "kvmetrics_rolled_back_tokens_total")
    failed_blocks = _total(samples, "kvmetrics_kv_load_blocks_total", 'outcome="failed"')
    same = (ours_requests, ours_tokens) == (requests, tokens)
    print(f"\nfailed blocks {failed_blocks:g}; failed requests: kvmetrics {ours_requests:g}, "
          f"vLLM {requests}; rolled-back tokens: kvmetrics {ours_tokens:g}, vLLM {tokens}: "
          + ("equal" if same else "DIFFERENT"))
    return 0 if same and failed_blocks > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
