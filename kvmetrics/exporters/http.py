"""The scrape endpoint: a small asyncio HTTP/1.1 server that no client can stall.

Why not prometheus-client's ``start_http_server``: it runs the TLS handshake inside
its single accept loop with no timeout (one silent TCP connection stops every
scrape), listens with a backlog of 5, and gives every connection a thread that
waits forever for a request line (200 idle sockets, 202 threads). A bounded pool of
threads does not cure this either: N slow clients hold N workers.

Here one event loop in one daemon thread owns every socket. A plain connection
costs a file descriptor and a few KB until it sends a whole request head, so idle
and slow-loris clients hold no thread and are closed after ``header_timeout_s``.
Who gets in, how many TLS sessions exist and how fast requests are answered is
:mod:`.admission`'s policy; what a request is answered with (a page rendered at most
once per ``page_max_age_s``, the format negotiated from a fixed table) is
:mod:`.pages`'. Only rendering runs on a thread pool, so a render never blocks
accepting or reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.registry import Collector

from kvmetrics.exporters.admission import (
    Connection,
    ConnectionTable,
    RequestRate,
    ServerLimits,
    State,
)
from kvmetrics.exporters.lean_tls import start_tls
from kvmetrics.exporters.pages import Page, PageCache, render_page, route
from kvmetrics.exporters.request_head import BadRequest, RequestHead, parse_head
from kvmetrics.metrics.logs import get_logger

__all__ = ["HTTPEndpoint", "Page", "ServerLimits", "render_page", "start_endpoint"]

log = get_logger("kvmetrics.http")

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 413: "Content Too Large", 429: "Too Many Requests",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable", 505: "HTTP Version Not Supported"}
#: Over the request rate: answered at once, from memory, never queued.
_TOO_MANY = Page(429, [("Retry-After", "1")], b"too many requests; try again in a second\n")
#: The page was not ready in time (a render stuck or very slow).
_NOT_READY = Page(503, [("Retry-After", "1")], b"the page is not ready; try again\n")
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


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
    listener: socket.socket
    stats: _Stats
    table: ConnectionTable
    pages: PageCache
    rate: RequestRate
    connections: set[Connection] = field(default_factory=set)

    def refresh(self) -> None:
        """The next page is collected anew, whatever its age (thread-safe)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.pages.invalidate)

    def stop(self, timeout: float = 5.0) -> None:
        async def close() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.listener.close()

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
        self.listener.close()


def start_endpoint(collector: Collector, host: str, port: int,
                   tls: ssl.SSLContext | None = None,
                   limits: ServerLimits | None = None,
                   on_page: Callable[[], None] | None = None) -> HTTPEndpoint:
    """Bind ``host:port`` now (errors raise here, in the caller) and serve ``collector``
    from a daemon thread."""
    limits = limits or ServerLimits.from_env(os.environ)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=limits.backlog)
    sock.setblocking(False)
    # The stdlib loop, whatever event-loop policy the host process installed (uvloop,
    # say): its behaviour under the limits above is what the tests pin down.
    loop = asyncio.SelectorEventLoop()
    pool = ThreadPoolExecutor(limits.render_threads, thread_name_prefix="kvmetrics-render")
    stats = _Stats()
    errors = _ThrottledLog(60.0, "rendering the metrics page")

    def render_failed(e: BaseException) -> None:
        stats.errors += 1
        errors.failed(e)

    table = ConnectionTable(limits.max_connections, limits.max_tls_sessions)
    pages = PageCache(collector, limits.page_max_age_s, pool, render_failed)
    rate = RequestRate(limits.max_requests_per_s, limits.max_requests_per_s)
    handler = _Handler(tls, limits, stats, table, pages, rate, on_page)
    loop.create_task(handler.accept_loop(sock))
    thread = threading.Thread(target=loop.run_forever, name="kvmetrics-http", daemon=True)
    thread.start()
    bound = sock.getsockname()
    return HTTPEndpoint(str(bound[0]), int(bound[1]), loop, thread, pool, sock, stats, table,
                        pages, rate, table.open)


class _ThrottledLog:
    """One line at most every ``every_s`` (a traceback only the first time): a client
    that makes every request fail must not fill the engine's log."""

    def __init__(self, every_s: float, what: str) -> None:
        self.every_s, self.what = every_s, what
        self._last = float("-inf")
        self._suppressed = 0
        self._first = True

    def failed(self, e: BaseException) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._suppressed += 1
            return
        self._last, suppressed, self._suppressed = now, self._suppressed, 0
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        log.warning("kvmetrics: %s failed: %s: %.200r%s", self.what, type(e).__name__,
                    str(e), more, exc_info=self._first)
        self._first = False


@dataclass
class _Handler:
    tls: ssl.SSLContext | None
    limits: ServerLimits
    stats: _Stats
    table: ConnectionTable
    pages: PageCache
    rate: RequestRate
    on_page: Callable[[], None] | None
    failures: _ThrottledLog = field(
        default_factory=lambda: _ThrottledLog(60.0, "a metrics endpoint connection"))

    async def accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as e:
                if e.errno in _OUT_OF_FDS:  # make room as at the cap, then try again
                    self.table.evict_idle()
                    await asyncio.sleep(0.05)
                continue
            except Exception as e:  # never let the endpoint stop accepting
                self.stats.errors += 1
                self.failures.failed(e)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            conn = Connection()
            if not self.table.admit(conn):
                self.stats.refused += 1
                _reset(sock)  # every connection is being answered: a reset, no work
                continue
            self.stats.accepted += 1
            conn.task = loop.create_task(self.connection(conn, sock))

    async def connection(self, conn: Connection, sock: socket.socket) -> None:
        writer: asyncio.StreamWriter | None = None
        graceful = False
        try:
            reader, writer = await self._open(conn, sock)
            graceful = await self._serve(conn, sock, reader, writer)
        except TimeoutError:
            self.stats.timed_out += 1
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError, ConnectionError,
                asyncio.CancelledError):
            pass  # gone, failed its handshake, evicted or the endpoint stops
        except Exception as e:
            self.stats.errors += 1
            self.failures.failed(e)
        finally:
            self.table.release(conn)
            if writer is None:
                sock.close()
            elif graceful:  # flush what drain() left, but not for ever
                writer.close()
                asyncio.get_running_loop().call_later(self.limits.write_timeout_s,
                                                      writer.transport.abort)
            else:
                writer.transport.abort()

    async def _open(self, conn: Connection, sock: socket.socket
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Streams over ``sock``. TLS: only once the client has sent its first bytes and
        a TLS slot is free, handshake included in ``header_timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.limits.header_timeout_s
        reader = asyncio.StreamReader(limit=self.limits.max_header_bytes, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader)
        if self.tls is None:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
            return reader, asyncio.StreamWriter(transport, protocol, reader, loop)
        await asyncio.wait_for(_readable(loop, sock), self.limits.header_timeout_s)
        await self.table.tls_slot(conn, deadline - time.monotonic())
        remaining = max(0.001, deadline - time.monotonic())
        transport = await asyncio.wait_for(
            start_tls(loop, sock, protocol, self.tls, remaining), remaining)
        return reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    async def _serve(self, conn: Connection, sock: socket.socket,
                     reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer requests until the connection ends; True if it ended cleanly."""
        limits = self.limits
        deadline = conn.since + limits.header_timeout_s
        while True:
            try:
                # asyncio.timeout, not wait_for: no task per request (the loop thread's
                # time per answer is GIL the engine waits for)
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    raw = await reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                return await self._refuse(conn, reader, writer, 431, "request head too large")
            except asyncio.IncompleteReadError:
                return True  # closed between requests
            self.table.enter(conn, State.BUSY)
            try:
                head = parse_head(raw)
            except BadRequest as e:
                return await self._refuse(conn, reader, writer, e.status, str(e))
            if _gone(sock, writer):
                return False  # asked and left (reset): nothing is done for it
            page = await self._page_for(head, sock, writer)
            if page is None:
                return False
            await self._answer(writer, page, head.keeps_alive, head_only=head.method == "HEAD")
            if page.status == 200 and head.method in ("GET", "HEAD") and \
                    self.on_page is not None:
                self.on_page()
            if not head.keeps_alive:
                return True
            self.table.enter(conn, State.IDLE)
            deadline = conn.since + limits.keepalive_timeout_s

    async def _page_for(self, head: RequestHead, sock: socket.socket,
                        writer: asyncio.StreamWriter) -> Page | None:
        """What ``head`` is answered with: its page, 429 over the request rate, 503 when
        the page is not ready within ``request_timeout_s``; None if the client left
        meanwhile."""
        routed = route(head.method, head.target, head.headers)
        if isinstance(routed, Page):
            return routed
        if not self.rate.admit():
            return _TOO_MANY
        try:
            async with asyncio.timeout(self.limits.request_timeout_s):
                page = await self.pages.page(routed)
        except TimeoutError:
            self.stats.timed_out += 1
            return _NOT_READY
        return None if _gone(sock, writer) else page

    async def _refuse(self, conn: Connection, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter, status: int, why: str) -> bool:
        """Answer ``status`` and close, reading (and dropping) what the client still
        sends for a while: closing with unread bytes would reset the connection
        before the client reads the answer."""
        self.table.enter(conn, State.BUSY)
        await self._answer(writer, Page(status, [], f"{why}\n".encode()), False)
        if writer.can_write_eof():
            writer.write_eof()
        budget = self.limits.max_linger_bytes
        try:
            async with asyncio.timeout(self.limits.linger_s):
                while budget > 0:
                    chunk = await reader.read(min(65536, budget))
                    if not chunk:
                        return True
                    budget -= len(chunk)
        except TimeoutError:
            pass
        return False

    async def _answer(self, writer: asyncio.StreamWriter, page: Page, keep_alive: bool,
                      head_only: bool = False) -> None:
        lines = [f"HTTP/1.1 {page.status} {_REASONS.get(page.status, 'Error')}",
                 *(f"{k}: {v}" for k, v in page.headers),
                 f"Content-Length: {len(page.body)}",
                 "Connection: keep-alive" if keep_alive else "Connection: close"]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(page.body)
        async with asyncio.timeout(self.limits.write_timeout_s):
            await writer.drain()
        self.stats.served += 1


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Until ``sock`` has bytes (or EOF) to read; nothing is read."""
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: None if ready.done() else ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


def _gone(sock: socket.socket, writer: asyncio.StreamWriter) -> bool:
    """Whether the client has reset the connection (or the endpoint closed it): a
    look at the socket's error state, nothing read. A client that only half-closed
    (sent its request, then FIN) still reads its answer and is not gone."""
    if writer.transport.is_closing():
        return True
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError, ssl.SSLError):
        return False
    except OSError:
        return True  # reset, or closed under us
    return False


def _reset(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0): no FIN handshake, no TIME_WAIT kept here."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
