"""The scrape endpoint: a small asyncio HTTP/1.1 server that no client can stall.

Why not prometheus-client's ``start_http_server``: it runs the TLS handshake inside
its single accept loop with no timeout (one silent TCP connection stops every
scrape), listens with a backlog of 5, and gives every connection a thread that
waits forever for a request line (200 idle sockets, 202 threads). A bounded pool of
threads does not cure this either: N slow clients hold N workers.

Here one event loop in one daemon thread owns every socket. A connection costs a
file descriptor and a few KB until it sends a whole request head, so idle and
slow-loris clients hold no thread and are closed after ``header_timeout_s``. The TLS
handshake is non-blocking (``start_tls``) under the same deadline, and starts only
after the connection was admitted under ``max_connections`` (excess connections
are reset at once, before any handshake work). Only rendering runs on a small
thread pool, so a render never blocks accepting or reading. The exposition itself
(text format, OpenMetrics negotiation, gzip) is prometheus-client's.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

log = logging.getLogger("kvmetrics.http")

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 413: "Content Too Large",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable", 505: "HTTP Version Not Supported"}
_ALLOW = "GET, HEAD, OPTIONS"


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost the endpoint; defaults sized for one scraper per replica
    plus a few curious people, with room to spare."""

    #: ``listen()`` backlog: connections the kernel queues before the loop accepts them.
    backlog: int = 128
    #: Open connections at once; one more is reset as soon as it is accepted.
    max_connections: int = 1024
    #: From accept to a whole request head (TLS handshake included).
    header_timeout_s: float = 10.0
    #: A kept-alive connection waiting for its next request (Prometheus reuses one
    #: connection per target; it reconnects if this closed it).
    keepalive_timeout_s: float = 60.0
    #: Writing one answer (a client that does not read is dropped).
    write_timeout_s: float = 10.0
    #: Request line plus headers.
    max_header_bytes: int = 16 * 1024
    #: Threads that render pages (scrapes beyond this wait their turn in order).
    render_threads: int = 2


@dataclass
class Page:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


def render_page(collector: Collector, method: str, target: str,
                headers: dict[str, str]) -> Page:
    """The answer to one request, prometheus-client's exposition negotiated as its
    own server does (``Accept``, ``Accept-Encoding``, ``name[]``)."""
    if method == "OPTIONS":
        return Page(200, [("Allow", _ALLOW)], b"")
    if method not in ("GET", "HEAD"):
        return Page(405, [("Allow", _ALLOW)], f"method {method} not allowed\n".encode())
    parts = urlsplit(target)
    if parts.path == "/favicon.ico":
        return Page(404, [], b"")
    names = parse_qs(parts.query).get("name[]")
    source: Collector = collector if names is None else _Restricted(collector, set(names))
    encoder, content_type = choose_encoder(headers.get("accept", ""))
    body = encoder(source)
    out = [("Content-Type", content_type)]
    if gzip_accepted(headers.get("accept-encoding", "")):
        body = gzip.compress(body, compresslevel=6)
        out.append(("Content-Encoding", "gzip"))
    return Page(200, out, body)


class PageUnavailable(Exception):
    """Raised by a collector whose values cannot be read for a known reason (it logs
    that itself): the scrape fails with 503 and that one line, not a traceback."""


class _Restricted(Collector):
    """The families with at least one sample of a requested name, trimmed to those
    samples: prometheus-client's ``name[]`` rule, applied at collect time so that it
    also works for families that appear later (multiprocess mode)."""

    def __init__(self, source: Collector, names: set[str]) -> None:
        self.source, self.names = source, names

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            samples = [s for s in family.samples if s.name in self.names]
            if samples:
                copy = Metric(family.name, family.documentation, family.type, family.unit)
                copy.samples = samples
                yield copy


@dataclass
class _Stats:
    accepted: int = 0
    refused: int = 0
    timed_out: int = 0
    served: int = 0
    errors: int = 0


@dataclass
class HTTPEndpoint:
    """A running endpoint; :meth:`stop` closes every connection and joins the thread."""

    host: str
    port: int
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    pool: ThreadPoolExecutor
    server: asyncio.base_events.Server
    stats: _Stats
    connections: set[asyncio.StreamWriter] = field(default_factory=set)

    def stop(self, timeout: float = 5.0) -> None:
        async def close() -> None:
            self.server.close()
            for writer in list(self.connections):
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.server.wait_closed()

        if self.loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout)
        except Exception:
            log.exception("kvmetrics: closing the metrics endpoint failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        self.pool.shutdown(wait=False, cancel_futures=True)
        if not self.thread.is_alive():
            self.loop.close()


def start_endpoint(collector: Collector, host: str, port: int,
                   tls: ssl.SSLContext | None = None,
                   limits: ServerLimits | None = None,
                   on_page: Callable[[], None] | None = None) -> HTTPEndpoint:
    """Bind ``host:port`` now (errors raise here, in the caller) and serve ``collector``
    from a daemon thread."""
    limits = limits or ServerLimits()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=limits.backlog)
    # The stdlib loop, whatever event-loop policy the host process installed (uvloop,
    # say): its behaviour under the limits above is what the tests pin down.
    loop = asyncio.SelectorEventLoop()
    pool = ThreadPoolExecutor(limits.render_threads, thread_name_prefix="kvmetrics-render")
    stats = _Stats()
    connections: set[asyncio.StreamWriter] = set()
    handler = _Handler(collector, tls, limits, pool, stats, connections, on_page)
    try:
        server = loop.run_until_complete(asyncio.start_server(
            handler.connection, sock=sock, backlog=limits.backlog,
            limit=limits.max_header_bytes))
    except BaseException:
        sock.close()
        loop.close()
        pool.shutdown(wait=False)
        raise
    thread = threading.Thread(target=loop.run_forever, name="kvmetrics-http", daemon=True)
    thread.start()
    bound = sock.getsockname()
    return HTTPEndpoint(str(bound[0]), int(bound[1]), loop, thread, pool, server, stats,
                        connections)


class _BadRequest(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


@dataclass
class _Handler:
    collector: Collector
    tls: ssl.SSLContext | None
    limits: ServerLimits
    pool: ThreadPoolExecutor
    stats: _Stats
    connections: set[asyncio.StreamWriter]
    on_page: Callable[[], None] | None

    async def connection(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        if len(self.connections) >= self.limits.max_connections:
            self.stats.refused += 1
            writer.transport.abort()  # a reset now, not a handshake or a thread
            return
        self.stats.accepted += 1
        self.connections.add(writer)
        try:
            await self._serve(reader, writer)
        except TimeoutError:
            self.stats.timed_out += 1
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away or failed its handshake: nothing to answer
        except Exception:
            self.stats.errors += 1
            log.exception("kvmetrics: metrics endpoint connection failed")
        finally:
            self.connections.discard(writer)
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        limits = self.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.header_timeout_s
        if self.tls is not None:
            await writer.start_tls(self.tls, ssl_handshake_timeout=limits.header_timeout_s)
        while True:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                              max(0.0, deadline - loop.time()))
            except asyncio.LimitOverrunError:
                await self._answer(writer, Page(431, [], b"request head too large\n"), False)
                return
            except asyncio.IncompleteReadError:
                return  # closed between requests
            try:
                method, target, version, headers = _parse_head(head)
            except _BadRequest as e:
                await self._answer(writer, Page(e.status, [], f"{e}\n".encode()), False)
                return
            keep_alive = _keeps_alive(version, headers)
            page = await loop.run_in_executor(self.pool, self._render, method, target, headers)
            await self._answer(writer, page, keep_alive, head_only=method == "HEAD")
            if page.status == 200 and method in ("GET", "HEAD") and self.on_page is not None:
                self.on_page()
            if not keep_alive:
                return
            deadline = loop.time() + limits.keepalive_timeout_s

    def _render(self, method: str, target: str, headers: dict[str, str]) -> Page:
        try:
            return render_page(self.collector, method, target, headers)
        except PageUnavailable as e:
            self.stats.errors += 1
            return Page(503, [], f"{e}\n".encode())
        except Exception as e:
            self.stats.errors += 1
            log.exception("kvmetrics: rendering the metrics page failed")
            return Page(500, [], f"rendering failed: {type(e).__name__}\n".encode())

    async def _answer(self, writer: asyncio.StreamWriter, page: Page, keep_alive: bool,
                      head_only: bool = False) -> None:
        lines = [f"HTTP/1.1 {page.status} {_REASONS.get(page.status, 'Error')}",
                 *(f"{k}: {v}" for k, v in page.headers),
                 f"Content-Length: {len(page.body)}",
                 "Connection: keep-alive" if keep_alive else "Connection: close"]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(page.body)
        await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)
        self.stats.served += 1


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """Request line and headers (names lower-cased); _BadRequest for anything off."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError as e:  # latin-1 decodes any byte; kept for clarity
        raise _BadRequest(400, "undecodable request") from e
    request_line, *header_lines = text[:-4].split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3:
        raise _BadRequest(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise _BadRequest(505, "only HTTP/1.0 and HTTP/1.1")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _BadRequest(400, "malformed header")
        headers[name.lower()] = value.strip()
    if headers.get("content-length", "0").strip() not in ("", "0") or \
            "transfer-encoding" in headers:
        raise _BadRequest(413, "a scrape has no request body")
    return method, target, version, headers


def _keeps_alive(version: str, headers: dict[str, str]) -> bool:
    connection = headers.get("connection", "").lower()
    if version == "HTTP/1.0":
        return "keep-alive" in connection
    return "close" not in connection
