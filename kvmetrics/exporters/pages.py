"""What a scrape is answered with: the format negotiated from ``Accept`` and a page
rendered at most once per ``max_age_s``, whatever the number of clients.

Why a cache: the endpoint runs inside the engine's process, and rendering is Python
that holds the GIL. Eight keep-alive clients asking for pages as fast as they could
doubled a lab run's wall time. Here the registry is collected at most once per
``max_age_s`` (one *snapshot*); every page asked for in that window (any format,
gzip or not, any ``name[]`` filter) is encoded from that snapshot, once per variant,
and served from memory to every later client. A scrape therefore sees values at
most ``max_age_s`` old, measured from the start of the collection.

Why our own negotiation: prometheus-client's ``choose_encoder`` copies the
``version=`` of ``Accept`` into ``Content-Type`` as the client wrote it (a line
feed in it became a header of the client's choosing) and raises on a version it
cannot compare (``x.y``: HTTP 500 and a traceback per request). Here only the
versions this prometheus-client can write are chosen, every header value comes
from a fixed table, and anything else falls back to the text format.
"""

from __future__ import annotations

import asyncio
import gzip
import inspect
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from urllib.parse import parse_qs, urlsplit

from prometheus_client import exposition
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as om_exposition
from prometheus_client.registry import Collector

from kvmetrics.metrics.logs import get_logger

log = get_logger("kvmetrics.http")

_ALLOW = "GET, HEAD, OPTIONS"
#: Pages kept per snapshot (variants: format x gzip x ``name[]``); more are rendered
#: but not kept, so odd ``name[]`` lists cannot grow the cache.
MAX_CACHED_VARIANTS = 16


class PageUnavailable(Exception):
    """Raised by a collector whose values cannot be read for a known reason (it logs
    that itself): the scrape fails with 503 and that one line, not a traceback."""


@dataclass
class Page:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass(frozen=True)
class Format:
    """One exposition format this prometheus-client writes; ``content_type`` is ours."""

    content_type: str
    encode: Callable[[Collector], bytes]


def _keywords(fn: Callable[..., bytes]) -> set[str]:
    return set(inspect.signature(fn).parameters)


_ESCAPINGS = tuple(getattr(om_exposition, name) for name in
                   ("UNDERSCORES", "ALLOWUTF8", "DOTS", "VALUES") if hasattr(om_exposition, name))
_OM_KEYWORDS = _keywords(om_exposition.generate_latest)
_TEXT_KEYWORDS = _keywords(exposition.generate_latest)
#: The plain text format, 0.0.4: what any other ``Accept`` gets.
TEXT = Format(exposition.CONTENT_TYPE_PLAIN_0_0_4 if hasattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4")
              else "text/plain; version=0.0.4; charset=utf-8", exposition.generate_latest)


def _openmetrics(version: str | None, escaping: str | None) -> Format | None:
    """OpenMetrics ``version`` (None: not given), or None if this client cannot write it."""
    if version is None:
        return Format(om_exposition.CONTENT_TYPE_LATEST, om_exposition.generate_latest)
    known = ("1.0.0", "2.0.0") if "version" in _OM_KEYWORDS else ("1.0.0",)
    if version not in known:
        return None
    kwargs: dict[str, str] = {}
    content_type = f"application/openmetrics-text; version={version}; charset=utf-8"
    if "version" in _OM_KEYWORDS:
        kwargs["version"] = version
    if escaping is not None and "escaping" in _OM_KEYWORDS:
        kwargs["escaping"] = escaping
        content_type += f"; escaping={escaping}"
    return Format(content_type, partial(om_exposition.generate_latest, **kwargs))


def _text(version: str | None, escaping: str | None) -> Format | None:
    """Text format 1.0.0 (with escaping) where this client has it; None otherwise."""
    if version != "1.0.0" or escaping is None or "escaping" not in _TEXT_KEYWORDS:
        return None
    return Format(f"text/plain; version=1.0.0; charset=utf-8; escaping={escaping}",
                  partial(exposition.generate_latest, escaping=escaping))


def negotiate(accept: str) -> Format:
    """The first ``Accept`` entry this endpoint can serve, in the client's order (as
    prometheus-client does; ``q`` is ignored), else :data:`TEXT`. Never raises."""
    for entry in accept.split(",")[:32]:
        media, *params = (p.strip() for p in entry.split(";"))
        values = dict(p.partition("=")[::2] for p in params if "=" in p)
        version = values.get("version")
        escaping = values.get("escaping")
        escaping = (escaping if escaping in _ESCAPINGS else _ESCAPINGS[0]) if _ESCAPINGS \
            else None
        if media == "application/openmetrics-text":
            chosen = _openmetrics(version, escaping)
        elif media == "text/plain":
            chosen = _text(version, escaping)
        else:
            chosen = None
        if chosen is not None:
            return chosen
    return TEXT


class _Snapshot(Collector):
    """Families collected once, served to every encoder of one window."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


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


def encode(source: Collector, fmt: Format, gzipped: bool,
           names: frozenset[str] | None) -> Page:
    """One page of ``source`` (a collector or a snapshot)."""
    body = fmt.encode(source if names is None else _Restricted(source, set(names)))
    headers = [("Content-Type", fmt.content_type)]
    if gzipped:
        body = gzip.compress(body, compresslevel=6)
        headers.append(("Content-Encoding", "gzip"))
    return Page(200, headers, body)


#: (format, gzip, ``name[]``): what makes two requests' pages differ.
Variant = tuple[Format, bool, "frozenset[str] | None"]


def route(method: str, target: str, headers: dict[str, str]) -> Page | Variant:
    """The answer that needs no rendering, or the page variant to render."""
    if method == "OPTIONS":
        return Page(200, [("Allow", _ALLOW)], b"")
    if method not in ("GET", "HEAD"):
        return Page(405, [("Allow", _ALLOW)], b"method not allowed\n")
    parts = urlsplit(target)
    if parts.path == "/favicon.ico":
        return Page(404, [], b"")
    names = parse_qs(parts.query).get("name[]")
    gzipped = exposition.gzip_accepted(headers.get("accept-encoding", ""))
    return (negotiate(headers.get("accept", "")), gzipped,
            None if names is None else frozenset(names))


def render_page(collector: Collector, method: str, target: str,
                headers: dict[str, str]) -> Page:
    """The answer to one request, rendered now (no cache): benchmarks and tests."""
    routed = route(method, target, headers)
    return routed if isinstance(routed, Page) else encode(collector, *routed)


class PageCache:
    """Pages of one collector, collected at most once per ``max_age_s``.

    Used from the endpoint's event loop only; collection and encoding run on
    ``pool``, one at a time (concurrent misses wait for the render in progress and
    then find its page).
    """

    def __init__(self, collector: Collector, max_age_s: float, pool: Executor,
                 on_error: Callable[[BaseException], None]) -> None:
        self.collector, self.max_age_s, self.pool = collector, max_age_s, pool
        self.on_error = on_error
        self._snapshot: _Snapshot | None = None
        self._taken = float("-inf")
        self._pages: dict[Variant, Page] = {}
        self._lock = asyncio.Lock()
        #: Bumped by :meth:`invalidate`: a collection begun before is not kept.
        self._generation = 0
        #: Collections done (a test and the benchmark read it).
        self.collections = 0

    def invalidate(self) -> None:
        """The values changed in a way a scraper must see at once (a run finished): the
        next request collects again. Event loop thread only."""
        self._generation += 1
        self._taken, self._pages = float("-inf"), {}

    def _fresh(self, variant: Variant) -> Page | None:
        if time.monotonic() - self._taken >= self.max_age_s:
            return None
        return self._pages.get(variant)

    async def page(self, variant: Variant) -> Page:
        page = self._fresh(variant)
        if page is not None:
            return page
        async with self._lock:
            page = self._fresh(variant)
            if page is not None:
                return page
            stale = time.monotonic() - self._taken >= self.max_age_s
            snapshot = None if stale else self._snapshot
            generation = self._generation
            loop = asyncio.get_running_loop()
            snapshot, taken, rendered = await loop.run_in_executor(
                self.pool, self._render, snapshot, variant)
            if generation != self._generation:
                return rendered  # invalidated meanwhile: this page is not kept
            if stale:
                self._snapshot, self._taken, self._pages = snapshot, taken, {}
                self.collections += 1
            if len(self._pages) < MAX_CACHED_VARIANTS:
                self._pages[variant] = rendered
            return rendered

    def _render(self, snapshot: _Snapshot | None,
                variant: Variant) -> tuple[_Snapshot | None, float, Page]:
        """(the snapshot used, when it was taken, the page); a failure is a 500 page,
        kept for the window like any other (a broken collector costs one try per window)."""
        taken = time.monotonic() if snapshot is None else self._taken
        try:
            if snapshot is None:
                snapshot = _Snapshot(self.collector.collect())
            return snapshot, taken, encode(snapshot, *variant)
        except PageUnavailable as e:  # logged by the collector, once per outage
            return snapshot, taken, Page(503, [], f"{e}\n".encode())
        except Exception as e:
            self.on_error(e)
            return snapshot, taken, Page(500, [], f"rendering failed: {type(e).__name__}\n"
                                         .encode())
