"""The exporter process: serves one engine's multiprocess files as ``/metrics``.

Started by :class:`kvmetrics.exporters.process.ServeProcess` in the engine, never by
hand. It reads the files with kvmetrics' bounded reader
(:class:`~kvmetrics.exporters.multiprocess.TolerantMultiProcessCollector`) and serves
them with kvmetrics' endpoint (its limits and TLS): prometheus-client's own HTTP
server has neither, and a process of its own does not make an unbounded server safe
for the scrapers that share it.

It reports one line over the lifeline socket the engine passed it (``bound PORT URL``
or ``error REASON``) and then waits for EOF there: the engine sends one byte and
closes its end to stop it, and the kernel closes it when the engine dies in any way.
It also asks for SIGTERM when its parent dies (Linux). When the engine died (EOF
without that byte) and the directory is the engine's private one, it removes the
directory; a stopped exporter leaves it to the engine, whose other exporters may
still serve it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import select
import shutil
import signal
import socket
import sys

from prometheus_client import CollectorRegistry, Counter

from kvmetrics.exporters.admission import ServerLimits
from kvmetrics.exporters.mmap_space import reserve_multiprocess_space
from kvmetrics.exporters.multiprocess import TolerantMultiProcessCollector
from kvmetrics.exporters.process import ENGINE_LIVES, use_multiprocess_values
from kvmetrics.exporters.prometheus import metric_for, serve
from kvmetrics.exporters.tls import TLSConfigError, TLSOptions
from kvmetrics.metrics.catalogue import SCRAPE_ERRORS

_PR_SET_PDEATHSIG = 1
#: No request-rate bound by default: what the bound protects in the engine (the GIL
#: its scheduler needs) is not in this process, and a bound that every client shares
#: is one a flood exhausts, answering the scraper 429. Renders stay bounded by the
#: page cache; ``KVMETRICS_SCRAPE_RATE`` still sets a bound when given.
CHILD_LIMITS = ServerLimits(max_requests_per_s=0)
#: How long a SIGTERM waits to learn whether the engine is gone too.
_EOF_WAIT_S = 2.0


def _die_with_parent() -> None:
    """SIGTERM to this process when its parent dies (Linux; elsewhere the lifeline's
    EOF is the only signal)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class _LeftOutFiles:
    """The exporter's count of the files it leaves out of a page, under the engine's
    ``kvmetrics_scrape_errors_total``. It goes to a value file of the exporter's own in
    the directory it serves, so the page merges it into that family (the engine writes
    its own reasons there); a family of the same name served beside it would make the
    page one Prometheus refuses. A restarted exporter's counts add to the last one's,
    whose file stays."""

    def __init__(self, directory: str, labels: tuple[str, str]) -> None:
        reserve_multiprocess_space()
        use_multiprocess_values(directory)
        counter = metric_for(SCRAPE_ERRORS, None)
        assert isinstance(counter, Counter)  # the catalogue declares it a counter
        self._counter = counter
        self._labels = labels
        self._warned = False

    def unreadable(self, _path: str) -> None:
        self._count("unreadable_multiprocess_file")

    def over_budget(self, _path: str) -> None:
        self._count("multiprocess_file_over_budget")

    def _count(self, reason: str) -> None:
        try:
            self._counter.labels(*self._labels, reason).inc()
        except Exception as e:  # the directory refuses the file: the page is served on
            if not self._warned:
                self._warned = True
                logging.getLogger("kvmetrics").warning(
                    "cannot count the files left out of the page: %s", e)


def _report(lifeline: socket.socket, line: str) -> None:
    with contextlib.suppress(OSError):
        lifeline.sendall((" ".join(line.split()) + "\n").encode("utf-8", "replace"))


def _bind_reason(e: BaseException) -> str:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return reason.split(" (while attempting to bind", 1)[0]


def _at_eof(lifeline: socket.socket) -> bool:
    """Whether the engine's end is closed (it may take a moment after the parent-death
    signal, which comes when the thread that started us ends, before the whole engine
    has)."""
    with contextlib.suppress(OSError):
        readable, _, _ = select.select([lifeline], [], [], _EOF_WAIT_S)
        return bool(readable) and lifeline.recv(64) == b""
    return True  # the socket is gone: so is the engine's end


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvmetrics.exporters.serve_process")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--lifeline-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--tls-client-ca")
    parser.add_argument("--owns-dir", action="store_true")
    parser.add_argument("--model-name", default="default")
    parser.add_argument("--engine", default="0")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _die_with_parent()
    exiting = False

    def on_sigterm(*_: object) -> None:
        # Once: a second one (the parent-death signal right after the EOF) must not cut
        # the clean-up short.
        nonlocal exiting
        if not exiting:
            exiting = True
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    logging.basicConfig(level=logging.INFO, format=f"kvmetrics exporter pid {os.getpid()}: "
                        "%(levelname)s %(message)s")
    lifeline = socket.socket(fileno=args.lifeline_fd)
    if os.getppid() != args.parent_pid:  # the engine died before the signal was asked for
        if args.owns_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
        return 0
    registry = CollectorRegistry(auto_describe=False)
    left_out = _LeftOutFiles(args.dir, (args.model_name, args.engine))
    registry.register(TolerantMultiProcessCollector(args.dir, on_bad_file=left_out.unreadable,
                                                    on_over_budget=left_out.over_budget))
    tls = TLSOptions(certfile=args.tls_cert, keyfile=args.tls_key,
                     client_cafile=args.tls_client_ca)
    try:
        server = serve(registry, args.host, args.port, tls=tls if tls.enabled else None,
                       limits=ServerLimits.from_env(os.environ, base=CHILD_LIMITS))
    except TLSConfigError as e:
        _report(lifeline, f"error {e}")
        return 1
    except (OSError, OverflowError) as e:
        _report(lifeline, f"error {_bind_reason(e)}")
        return 1
    #: At EOF: whether the engine stopped us on purpose (it lives on, and other
    #: exporters of it may share the directory: it removes the directory itself) or
    #: died. None: interrupted before EOF.
    stopped: bool | None = None
    try:
        _report(lifeline, f"bound {server.port} {server.url}")
        said = b""
        with contextlib.suppress(OSError):
            # The engine sends one byte only when it stops us on purpose, then closes:
            # this returns at EOF either way.
            while chunk := lifeline.recv(64):
                said += chunk[:1]
        exiting = True
        stopped = ENGINE_LIVES in said
    finally:
        exiting = True
        # A SIGTERM of our own (someone killed the exporter alone) keeps the files: the
        # engine lives, writes on and starts another exporter.
        engine_died = stopped is False or (stopped is None and _at_eof(lifeline))
        if args.owns_dir and engine_died:
            shutil.rmtree(args.dir, ignore_errors=True)
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
