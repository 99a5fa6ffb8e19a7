"""Reading prometheus-client's multiprocess ``*.db`` files with bounds, and merging them.

prometheus-client's own reader trusts each file: the pid in its name goes to
``os.kill`` whatever its size (``gauge_livesum_99999999999999999999.db`` raises
OverflowError on every scrape), and the byte count in its header is read as is (a
header claiming 2^31-1 bytes in a sparse file: 9-16 s and 4.2 GB per scrape). Here a
file is used only if its name is one the library writes, with a pid a process can
have, it is a regular file, and its header fits in both the file and
:data:`MAX_FILE_BYTES`; every entry is bounds-checked. Anything else is a
:class:`BadFile` with a one-line reason.

The merge is prometheus-client's (same sums, modes and pid labels, same histogram
accumulation) but kept as partial sums (:class:`Merged`), so that the unchanging files
of dead processes can be merged once and the live ones added on each scrape.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import struct
import time
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.metrics import Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

#: A file whose header says it holds more than this is left out (and counted), unread.
#: The largest real file holds every series of one process: with kvmetrics' caps and
#: vLLM's families that is a few MB.
MAX_FILE_BYTES = 64 << 20
#: Linux's largest pid (``PID_MAX_LIMIT``); a bigger number in a name is no process's.
MAX_PID = 1 << 22

_TYPES = ("counter", "gauge", "histogram", "summary")
_MODES = Gauge._MULTIPROC_MODES
_INT = struct.Struct("i")  # native, as prometheus-client writes it
_TWO_DOUBLES = struct.Struct("dd")

#: (metric name, sample name, sorted label pairs, help), the parsed form of a key.
Key = tuple[str, str, tuple[tuple[str, str], ...], str]
#: One value of a file: its parsed key, value and timestamp.
Entry = tuple[Key, float, float]


class BadFile(Exception):
    """A file left out of the page; the message says why in one line."""


class OverBudget(BadFile):
    """A file left out because reading it would pass the scrape's budget. ``lasting``:
    the file alone passes it (it is refused again, unread, while it stays the same)."""

    def __init__(self, why: str, lasting: bool = False) -> None:
        super().__init__(why)
        self.lasting = lasting


@dataclass(frozen=True)
class ScrapeBudget:
    """The most one scrape reads of the directory. A file that would pass a bound is
    left out (and counted) and the rest are served; this process's own files are
    always read (their size is bounded by the exporter's series caps).

    ``max_series``: distinct series on the page (a file with more entries than this
    is refused as soon as its parse passes it). ``max_bytes``: file bytes read in one
    scrape (a dead process's file, read once and kept merged, costs nothing on later
    scrapes). ``max_seconds``: time spent reading, checked between files and every
    few thousand entries.
    """

    max_series: int = 50_000
    max_bytes: int = 32 << 20
    max_seconds: float = 2.0


#: Entries parsed between two looks at the clock.
_CLOCK_EVERY = 4096


@dataclass(frozen=True)
class FileName:
    """What a ``*.db`` name says: the value type, the gauge mode and the writer's pid."""

    typ: str
    mode: str | None
    pid: int
    pid_text: str


@functools.lru_cache(maxsize=1 << 16)
def parse_name(path: str) -> FileName | None:
    """``counter_<pid>.db`` or ``gauge_<mode>_<pid>.db`` (and histogram, summary); None
    for any other name, or a pid no process can have (or written otherwise than the
    library writes it). Cached: a scrape asks for every name three times."""
    base = os.path.basename(path)
    if not base.endswith(".db"):
        return None
    parts = base[:-3].split("_")
    typ = parts[0]
    if typ == "gauge" and len(parts) == 3 and parts[1] in _MODES:
        mode, pid_text = parts[1], parts[2]
    elif typ in _TYPES and typ != "gauge" and len(parts) == 2:
        mode, pid_text = None, parts[1]
    else:
        return None
    if not (pid_text.isascii() and pid_text.isdigit()) or len(pid_text) > 8:
        return None
    pid = int(pid_text)
    ok = 0 < pid <= MAX_PID and pid_text == str(pid)  # no leading zeros
    return FileName(typ, mode, pid, pid_text) if ok else None


def read_bytes(path: str, max_bytes: int = MAX_FILE_BYTES,
               budget_bytes: int | None = None) -> bytes:
    """The used part of a file, after checking its header against its real size;
    OverBudget, after reading 8 bytes, if it holds more than ``budget_bytes``.

    Opened without following a link and without blocking (a FIFO named ``x.db``
    would otherwise hang the scrape); FileNotFoundError passes through (a process
    marked dead meanwhile), every other problem is a BadFile.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise BadFile(f"cannot open: {e.strerror or e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadFile("not a regular file")
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise BadFile(f"{len(head)} bytes, shorter than the 8-byte header")
        used = _INT.unpack_from(head)[0] or 8  # 0: made, not yet written
        if used < 8 or used > info.st_size:
            raise BadFile(f"header claims {used} bytes, the file has {info.st_size}")
        if used > max_bytes:
            raise BadFile(f"header claims {used} bytes, over the {max_bytes}-byte limit")
        if budget_bytes is not None and used > budget_bytes:
            raise OverBudget(f"{used} bytes, over the {budget_bytes} bytes left of the "
                             "scrape's budget")
        data = os.pread(fd, used, 0)
        if len(data) < used:
            raise BadFile(f"read {len(data)} of the {used} bytes its header claims")
        return data
    except OSError as e:
        raise BadFile(f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


def parse_entries(data: bytes, keys: dict[bytes, Key], max_entries: int | None = None,
                  deadline: float | None = None) -> tuple[Entry, ...]:
    """Every (key, value, timestamp) of a file's used bytes; BadFile at the first entry
    that does not fit or whose key is not prometheus-client's JSON, OverBudget past
    ``max_entries`` entries or the ``deadline`` (``time.monotonic()``). ``keys`` caches
    parsed keys across files and scrapes (the same few hundred keys recur)."""
    out: list[Entry] = []
    pos, used = 8, len(data)
    while pos < used:
        if len(out) % _CLOCK_EVERY == 0 and len(out):
            if max_entries is not None and len(out) > max_entries:
                raise OverBudget(f"more than {max_entries} series, the scrape's budget",
                                 lasting=True)
            if deadline is not None and time.monotonic() > deadline:
                raise OverBudget("reading it passed the scrape's time budget")
        if pos + 4 > used:
            raise BadFile(f"entry at byte {pos} cut off")
        n = _INT.unpack_from(data, pos)[0]
        padded = n + (8 - (n + 4) % 8)
        end = pos + 4 + padded + 16
        if n <= 0 or end > used:
            raise BadFile(f"entry at byte {pos} claims {n} bytes beyond the used {used}")
        raw = data[pos + 4:pos + 4 + n]
        key = keys.get(raw)
        if key is None:
            key = keys[raw] = _parse_key(raw, pos)
        value, timestamp = _TWO_DOUBLES.unpack_from(data, end - 16)
        out.append((key, value, timestamp))
        pos = end
    if max_entries is not None and len(out) > max_entries:
        raise OverBudget(f"{len(out)} series, over the scrape's budget of {max_entries}",
                         lasting=True)
    return tuple(out)


def _parse_key(raw: bytes, pos: int) -> Key:
    try:
        metric, name, labels, help_text = json.loads(raw.decode("utf-8"))
    except (ValueError, TypeError):
        raise BadFile(f"entry at byte {pos} is not a metric key") from None
    if not (isinstance(metric, str) and isinstance(name, str) and isinstance(help_text, str)
            and isinstance(labels, dict)
            and all(isinstance(v, str) for v in labels.values())):
        raise BadFile(f"entry at byte {pos} is not a metric key")
    return metric, name, tuple(sorted(labels.items())), help_text


#: A series' label pairs, sorted by name.
_Labels = tuple[tuple[str, str], ...]


@dataclass
class _Family:
    typ: str
    help: str
    mode: str | None
    #: (sample name, label pairs) -> [value, timestamp]
    values: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = field(
        default_factory=dict)


@dataclass
class Merged:
    """Partial sums of some files, combined as prometheus-client's merge combines them;
    :meth:`add` is associative, so a merge of the dead processes' files can be kept and
    the live files added to a copy of it on each scrape."""

    families: dict[str, _Family] = field(default_factory=dict)

    def copy(self) -> Merged:
        return Merged({name: _Family(f.typ, f.help, f.mode,
                                     {k: list(v) for k, v in f.values.items()})
                       for name, f in self.families.items()})

    def series(self) -> int:
        return sum(len(f.values) for f in self.families.values())

    def new_series(self, name: FileName, entries: tuple[Entry, ...]) -> int:
        """How many series :meth:`add` of these entries would create (at most)."""
        pid_label = name.typ == "gauge" and name.mode in ("all", "liveall")
        n = 0
        for (metric, sample, labels, _), _, _ in entries:
            family = self.families.get(metric)
            if pid_label:
                labels = (*labels, ("pid", name.pid_text))
            if family is None or (sample, labels) not in family.values:
                n += 1
        return n

    def add(self, name: FileName, entries: tuple[Entry, ...]) -> None:
        for (metric, sample, labels, help_text), value, timestamp in entries:
            family = self.families.get(metric)
            if family is None:
                family = self.families[metric] = _Family(name.typ, help_text, name.mode)
            elif name.mode is not None:
                family.mode = name.mode
            mode = name.mode or ""
            if name.typ == "gauge" and mode in ("all", "liveall"):
                labels = (*labels, ("pid", name.pid_text))
            slot = (sample, labels)
            current = family.values.get(slot)
            if name.typ != "gauge" or mode in ("sum", "livesum"):
                if current is None:
                    family.values[slot] = [value, 0.0]
                else:
                    current[0] += value
            elif mode in ("min", "livemin"):
                if current is None or value < current[0]:
                    family.values[slot] = [value, 0.0]
            elif mode in ("max", "livemax"):
                if current is None or value > current[0]:
                    family.values[slot] = [value, 0.0]
            elif mode in ("mostrecent", "livemostrecent"):
                # The library shows the latest write, and a value never written with a
                # timestamp (0) not at all.
                if timestamp > (0.0 if current is None else current[1]):
                    family.values[slot] = [value, timestamp]
            else:  # all, liveall: one series per pid
                family.values[slot] = [value, 0.0]

    def metrics(self) -> list[Metric]:
        """The families to expose (histogram buckets made cumulative, ``_count`` their
        total), as prometheus-client's ``MultiProcessCollector.merge(accumulate=True)``."""
        out = []
        for metric_name, family in self.families.items():
            metric = Metric(metric_name, family.help, family.typ)
            groups: dict[_Labels, dict[tuple[str, _Labels], float]] = defaultdict(dict)
            buckets: dict[_Labels, dict[float, float]] = defaultdict(lambda: defaultdict(float))
            for (sample, labels), (value, _) in family.values.items():
                le = next((v for k, v in labels if k == "le"), None)
                if family.typ == "histogram" and le is not None:
                    rest = tuple(p for p in labels if p[0] != "le")
                    try:
                        buckets[rest][float(le)] += value
                    except ValueError:
                        continue  # not a bucket bound: no sample to make of it
                else:
                    groups[labels][(sample, labels)] = value
            for labels, by_bound in buckets.items():
                total = 0.0
                for bound, value in sorted(by_bound.items()):
                    total += value
                    groups[labels][(f"{metric_name}_bucket",
                                    (*labels, ("le", floatToGoString(bound))))] = total
                groups[labels][(f"{metric_name}_count", labels)] = total
            metric.samples = [Sample(sample, dict(labels), value)
                              for group in groups.values()
                              for (sample, labels), value in group.items()]
            out.append(metric)
        return out
