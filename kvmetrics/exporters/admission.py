"""Who the scrape endpoint lets in, and at what pace: the connection policy.

Three bounds, each on something a client can otherwise grow without limit:

- **Connections.** At ``max_connections`` a new connection is admitted by closing
  the oldest one that is *idle*: first those that never sent a whole request (idle
  sockets, slow-loris heads), then kept-alive ones waiting for their next request.
  Only a connection that is being answered is never evicted. Refusing the newcomer
  instead (as before) let 1,025 silent sockets lock every scraper out for good.
- **TLS sessions.** SSL state costs tens of KB per connection (about 300 KB with
  asyncio's stock SSL protocol, which allocates a 256 KiB buffer per connection; the
  endpoint's own has 16 KiB), so it is created only once the client has sent its
  first bytes, and for at most ``max_tls_sessions`` connections at once; the oldest
  idle one makes room for a new one.
- **Requests.** At most ``max_requests_per_s`` requests are answered with a page per
  second (a token bucket); one over the bound is answered 429 at once, from memory.
  Nothing waits for a turn: a queue of requests is a queue that a client can fill
  with requests whose sender is long gone, and a scraper behind them is locked out
  for as long as the queue takes to drain.

Everything here runs on the endpoint's event loop thread: no locks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvmetrics.metrics import settings
from kvmetrics.metrics.logs import get_logger

log = get_logger("kvmetrics.http")


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost the endpoint; defaults sized for one scraper per replica
    plus a few curious people, with room to spare."""

    #: ``listen()`` backlog: connections the kernel queues before the loop accepts them.
    backlog: int = 128
    #: Open connections at once; past it the oldest idle one is closed to make room.
    max_connections: int = 1024
    #: TLS connections with SSL state (about 70 KB each) at once.
    max_tls_sessions: int = 32
    #: From accept to a whole request head (TLS handshake included).
    header_timeout_s: float = 10.0
    #: A kept-alive connection waiting for its next request (Prometheus reuses one
    #: connection per target; it reconnects if this closed it).
    keepalive_timeout_s: float = 60.0
    #: Writing one answer (a client that does not read is dropped).
    write_timeout_s: float = 10.0
    #: From a whole request head to its page being ready (a render in progress
    #: included); past it the answer is 503.
    request_timeout_s: float = 9.0
    #: Request line plus headers.
    max_header_bytes: int = 16 * 1024
    #: Threads that render pages. Renders run one at a time (concurrent cache misses
    #: wait for the render in progress and share its page), so one is enough.
    render_threads: int = 1
    #: A page is collected at most once per this many seconds and served from memory
    #: in between: a scrape sees values at most this old. 0: every scrape collects.
    page_max_age_s: float = 1.0
    #: Requests answered with a page per second, all clients together (one over the
    #: bound gets 429 at once); 0: no bound. The burst allowance is the same number.
    max_requests_per_s: float = 20.0
    #: After an error answer (431, 400...), how long the rest of the request is read
    #: and dropped, so that the client reads the answer instead of a reset.
    linger_s: float = 1.0
    #: ... and at most how many bytes of it: a client sending megabytes after its
    #: error answer gets a reset instead of a reader.
    max_linger_bytes: int = 1024 * 1024

    @classmethod
    def from_env(cls, environ: Mapping[str, str],
                 base: ServerLimits | None = None) -> ServerLimits:
        """``base`` (the defaults if None), with the page age and request rate an
        operator may set for every endpoint of a process tree (vLLM's EngineCores
        inherit them): ``KVMETRICS_SCRAPE_MAX_AGE_S`` and ``KVMETRICS_SCRAPE_RATE``. A
        value outside the setting's range (:mod:`kvmetrics.metrics.settings`) is logged
        (one line naming the range) and ``base``'s value kept here; a vLLM engine
        refuses it at start."""
        chosen: dict[str, float] = {}
        for var, name in _ENV_LIMITS.items():
            text = environ.get(var)
            if text is None or not text.strip():
                continue
            try:
                chosen[name] = settings.number(settings.BY_ENV[var], text)
            except ValueError as e:
                log.warning("%s; using %s", e, getattr(base or cls, name))
        # BY_ENV names float fields only
        return dataclasses.replace(base or cls(), **chosen)  # type: ignore[arg-type]


_ENV_LIMITS = {"KVMETRICS_SCRAPE_MAX_AGE_S": "page_max_age_s",
               "KVMETRICS_SCRAPE_RATE": "max_requests_per_s"}


class State(enum.IntEnum):
    """Eviction order: a lower state goes first; BUSY never."""

    FRESH = 0  #: accepted, no whole request yet
    IDLE = 1  #: answered, kept alive, waiting for the next request
    BUSY = 2  #: a request is being answered


@dataclass(eq=False)
class Connection:
    task: asyncio.Task[None] | None = None
    state: State = State.FRESH
    #: When it entered its state (monotonic), to find the oldest.
    since: float = field(default_factory=time.monotonic)
    #: Holds one of the ``max_tls_sessions`` TLS slots.
    tls: bool = False



class ConnectionTable:
    """The open connections, with eviction of the oldest idle ones when full."""

    def __init__(self, max_connections: int, max_tls_sessions: int) -> None:
        self.max_connections, self.max_tls_sessions = max_connections, max_tls_sessions
        self.open: set[Connection] = set()
        #: The evictable connections of each state, oldest first (O(1) eviction: at
        #: the cap every new connection evicts one).
        self._idle: dict[State, dict[Connection, None]] = {State.FRESH: {}, State.IDLE: {}}
        self.tls_sessions: set[Connection] = set()
        self._tls_freed = asyncio.Event()
        self.evicted = 0

    def admit(self, conn: Connection) -> bool:
        """Room for ``conn``, evicting the oldest idle connection if full; False when
        every connection is being answered."""
        if len(self.open) >= self.max_connections and not self.evict_idle():
            return False
        self.open.add(conn)
        self._idle[conn.state][conn] = None
        return True

    def enter(self, conn: Connection, state: State) -> None:
        """``conn`` is now in ``state`` (as of now, for the age order)."""
        if conn not in self.open:
            return  # evicted meanwhile
        self._idle.get(conn.state, {}).pop(conn, None)
        conn.state, conn.since = state, time.monotonic()
        if state in self._idle:
            self._idle[state][conn] = None

    def evict_idle(self) -> bool:
        """Close the oldest idle connection (at the cap, or out of file descriptors)."""
        for waiting in self._idle.values():
            if waiting:
                self._evict(next(iter(waiting)))
                return True
        return False

    def _evict_tls(self) -> bool:
        victims = [c for c in self.tls_sessions if c.state is not State.BUSY]
        if not victims:
            return False
        self._evict(min(victims, key=lambda c: (c.state, c.since)))
        return True

    def _evict(self, victim: Connection) -> None:
        self.release(victim)
        if victim.task is not None:
            victim.task.cancel()
        self.evicted += 1

    async def tls_slot(self, conn: Connection, timeout: float) -> None:
        """Wait (at most ``timeout``) for one of the TLS slots, evicting the oldest idle
        TLS connection if all are taken; TimeoutError if every holder stays busy."""
        deadline = time.monotonic() + timeout
        while len(self.tls_sessions) >= self.max_tls_sessions and not self._evict_tls():
            self._tls_freed.clear()
            await asyncio.wait_for(self._tls_freed.wait(), max(0.0, deadline - time.monotonic()))
        conn.tls = True
        self.tls_sessions.add(conn)

    def release(self, conn: Connection) -> None:
        """``conn`` is closed (or about to be): its slots are free. Idempotent."""
        self.open.discard(conn)
        self._idle.get(conn.state, {}).pop(conn, None)
        if conn.tls:
            conn.tls = False
            self.tls_sessions.discard(conn)
            self._tls_freed.set()


class RequestRate:
    """A token bucket of ``rate`` requests per second (``burst`` at once) that never
    makes a caller wait: :meth:`admit` says yes or no now. ``rate <= 0``: no bound."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, max(1.0, burst)
        self._tokens = self.burst
        self._last = time.monotonic()
        #: Requests refused for the bound (a test and the benchmark read it).
        self.refused = 0

    def admit(self) -> bool:
        """Whether one more request may be answered with a page now (and count it)."""
        if self.rate <= 0:
            return True
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens < 1:
            self.refused += 1
            return False
        self._tokens -= 1
        return True
