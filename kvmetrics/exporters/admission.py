"""Who the scrape endpoint lets in, and at what pace: the connection policy.

Three bounds, each on something a client can otherwise grow without limit:

- **Connections.** At ``max_connections`` a new connection is admitted by closing
  the oldest one that is *idle*: first those that never sent a whole request (idle
  sockets, slow-loris heads), then kept-alive ones waiting for their next request.
  Only a connection that is being answered is never evicted. Refusing the newcomer
  instead (as before) let 1,025 silent sockets lock every scraper out for good.
- **TLS sessions.** A TLS connection costs about 300 KB (asyncio's SSL protocol
  allocates a 256 KiB buffer per connection, OpenSSL its own state), so the SSL
  objects are created only once the client has sent its first bytes, and at most
  ``max_tls_sessions`` exist at once; the oldest idle one makes room for a new one.
- **Requests.** At most ``max_requests_per_s`` requests are answered per second
  (a token bucket, in arrival order); the others wait, holding no thread, so a
  flood of clients costs the engine a bounded share of its GIL.

Everything here runs on the endpoint's event loop thread: no locks.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field


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

    def enter(self, state: State) -> None:
        self.state, self.since = state, time.monotonic()


class ConnectionTable:
    """The open connections, with eviction of the oldest idle ones when full."""

    def __init__(self, max_connections: int, max_tls_sessions: int) -> None:
        self.max_connections, self.max_tls_sessions = max_connections, max_tls_sessions
        self.open: set[Connection] = set()
        self.tls_sessions: set[Connection] = set()
        self._tls_freed = asyncio.Event()
        self.evicted = 0

    def admit(self, conn: Connection) -> bool:
        """Room for ``conn``, evicting the oldest idle connection if full; False when
        every connection is being answered."""
        if len(self.open) >= self.max_connections and not self._evict_one(self.open):
            return False
        self.open.add(conn)
        return True

    def evict_idle(self) -> bool:
        """Close the oldest idle connection (out of file descriptors, say)."""
        return self._evict_one(self.open)

    def _evict_one(self, among: set[Connection]) -> bool:
        victims = [c for c in among if c.state is not State.BUSY]
        if not victims:
            return False
        victim = min(victims, key=lambda c: (c.state, c.since))
        self.release(victim)
        if victim.task is not None:
            victim.task.cancel()
        self.evicted += 1
        return True

    async def tls_slot(self, conn: Connection, timeout: float) -> None:
        """Wait (at most ``timeout``) for one of the TLS slots, evicting the oldest idle
        TLS connection if all are taken; TimeoutError if every holder stays busy."""
        deadline = time.monotonic() + timeout
        while len(self.tls_sessions) >= self.max_tls_sessions and \
                not self._evict_one(self.tls_sessions):
            self._tls_freed.clear()
            await asyncio.wait_for(self._tls_freed.wait(), max(0.0, deadline - time.monotonic()))
        conn.tls = True
        self.tls_sessions.add(conn)

    def release(self, conn: Connection) -> None:
        """``conn`` is closed (or about to be): its slots are free. Idempotent."""
        self.open.discard(conn)
        if conn.tls:
            conn.tls = False
            self.tls_sessions.discard(conn)
            self._tls_freed.set()


class RequestRate:
    """A token bucket of ``rate`` requests per second (``burst`` at once); callers wait
    their turn in arrival order. ``rate <= 0``: no bound."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, max(1.0, burst)
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = asyncio.Lock()
        #: Requests that had to wait (a test and the benchmark read it).
        self.delayed = 0

    async def take(self) -> None:
        if self.rate <= 0:
            return
        async with self._lock:
            self._refill()
            if self._tokens < 1:
                self.delayed += 1
                await asyncio.sleep((1 - self._tokens) / self.rate)
                self._refill()
            self._tokens -= 1

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
