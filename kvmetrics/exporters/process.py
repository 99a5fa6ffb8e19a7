"""The engine side of serving metrics from a separate process (``serve=process``).

The engine only records: its values go to prometheus-client's multiprocess files,
and a child process (:mod:`kvmetrics.exporters.serve_process`) reads those files and
serves ``/metrics``. Every byte a scrape client sends is then parsed on the child's
GIL, never on the one vLLM's scheduler needs.

:class:`ServeProcess` starts that child and keeps it running from one supervisor
thread that blocks on the child's exit: the engine pays nothing per step or per
request. The child dies with the engine (it holds one end of a socket pair whose other
end only the engine holds, so it sees EOF whatever way the engine ends, and it asks
the kernel for SIGTERM when its parent dies); if it dies alone, it is started again on
the port it had bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from kvmetrics.exporters.private_dirs import private_multiprocess_dir, remove_left_behind
from kvmetrics.exporters.prometheus import multiprocess_dir
from kvmetrics.exporters.prometheus_internals import (
    switch_to_memory_values,
    switch_to_multiprocess_values,
    values_in_memory,
)
from kvmetrics.exporters.tls import TLSOptions
from kvmetrics.metrics.logs import get_logger

log = get_logger("vllm.kvmetrics")

#: How long the engine waits for a new child to report its bind (Python start-up and
#: imports on a loaded 2-core host take a few seconds at worst).
REPORT_TIMEOUT_S = 60.0
#: Waits before restarting a child that died alone: doubled per failure in a row, capped.
RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 30.0
#: A report line is short; anything longer is cut (a child that misbehaves cannot make
#: the engine buffer without bound).
_MAX_REPORT_BYTES = 4096
#: What the engine sends before it closes its end of the lifeline on purpose.
ENGINE_LIVES = b"k"


class ServeFailed(Exception):
    """The child could not serve: its one-line reason."""


def use_multiprocess_values(directory: str) -> None:
    """Make this process's prometheus-client write every new value to ``directory``.

    The library chooses its value class from ``PROMETHEUS_MULTIPROC_DIR`` when it is
    first imported, which in a vLLM EngineCore happened long before kvmetrics runs;
    metrics made after this call (kvmetrics' own, made next) write to the files.
    """
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    switch_to_multiprocess_values()


@dataclass
class _PrivateDirectory:
    """The private directory of this process's values and the exporters that serve it.

    Engines built one after another in one process (tests, the lab) each start an
    exporter; they share one directory, made by the first and removed, with the
    environment and prometheus-client's value class put back as they were, when the
    last one stops. An engine that dies leaves the removal to its exporters.
    """

    path: str
    #: Exporters of this process serving ``path`` now.
    users: int
    #: Whether prometheus-client wrote values in memory before (then it does again).
    values_in_memory_before: bool


_private: _PrivateDirectory | None = None
_private_lock = threading.Lock()


def own_private_directory() -> str | None:
    """The private directory this process's exporters serve, if one is in use: a
    ``PROMETHEUS_MULTIPROC_DIR`` equal to it was set by kvmetrics, not by the user."""
    private = _private
    return None if private is None else private.path


def _lease_directory() -> tuple[str, bool]:
    """(the directory this engine's values go to, whether it is kvmetrics' own)."""
    global _private
    with _private_lock:
        directory = multiprocess_dir()
        if _private is not None and directory == _private.path:
            _private.users += 1
            return directory, True
        if directory is not None:
            return directory, False  # the user's: never removed by kvmetrics
        if removed := remove_left_behind():
            log.info("kvmetrics: removed %d metric file director%s left in %s by engines "
                     "that were killed", removed, "y" if removed == 1 else "ies",
                     tempfile.gettempdir())
        try:
            path = private_multiprocess_dir()
        except OSError as e:  # TMPDIR missing, full or not writable
            raise ServeFailed(f"cannot make a directory for the metric files: "
                              f"{e.strerror or e}") from None
        _private = _PrivateDirectory(path, 1, values_in_memory())
        return path, True


def _release_directory(path: str) -> None:
    """One exporter of ``path`` is gone; the last one removes it and puts back the
    environment and value class this process had."""
    global _private
    with _private_lock:
        private = _private
        if private is None or private.path != path:  # made by hand (a benchmark)
            shutil.rmtree(path, ignore_errors=True)
            return
        private.users -= 1
        if private.users > 0:
            return
        _private = None
        shutil.rmtree(path, ignore_errors=True)
        # It was unset when the lease began (else the user's directory is used).
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR") == path:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        if private.values_in_memory_before:
            switch_to_memory_values()


@dataclass(frozen=True)
class ChildSettings:
    """What the child is told: where the files are, where and how to serve them."""

    directory: str
    host: str
    port: int
    certfile: str | None = None
    keyfile: str | None = None
    client_cafile: str | None = None
    #: The child removes the directory when the engine is gone (a private one).
    owns_directory: bool = False
    #: The engine's ``model_name`` and ``engine`` labels, which the child's own count
    #: of the files it leaves out of a page carries.
    labels: tuple[str, str] = ("default", "0")

    def argv(self, lifeline_fd: int) -> list[str]:
        args = [sys.executable, "-m", "kvmetrics.exporters.serve_process",
                "--dir", self.directory, "--host", self.host, "--port", str(self.port),
                "--lifeline-fd", str(lifeline_fd), "--parent-pid", str(os.getpid())]
        for flag, value in (("--tls-cert", self.certfile), ("--tls-key", self.keyfile),
                            ("--tls-client-ca", self.client_cafile)):
            if value:
                args += [flag, value]
        if self.owns_directory:
            args.append("--owns-dir")
        return args + ["--model-name", self.labels[0], "--engine", self.labels[1]]


class ServeProcess:
    """One supervised exporter child: :meth:`start` returns its URL once it is bound."""

    def __init__(self, settings: ChildSettings) -> None:
        self.settings = settings
        self.process: subprocess.Popen[bytes] | None = None
        #: Children started after the first (each one a restart).
        self.restarts = 0
        self._lifeline: socket.socket | None = None
        self._stopping = threading.Event()
        self._first: list[str | ServeFailed] = []
        self._first_ready = threading.Event()
        self._thread: threading.Thread | None = None
        #: The URL served, once bound.
        self.url = ""

    def start(self) -> str:
        """Start the child and its supervisor; the URL served, or ServeFailed."""
        # Spawned from the supervisor thread, which lives as long as the child should:
        # the kernel's parent-death signal follows the thread that forked.
        self._thread = threading.Thread(target=self._supervise, name="kvmetrics-exporter",
                                        daemon=True)
        self._thread.start()
        self._first_ready.wait()
        outcome = self._first[0]
        if isinstance(outcome, ServeFailed):
            raise outcome
        self.url = outcome
        return outcome

    def _spawn(self) -> str:
        """A new child; the URL it serves, or ServeFailed (the child is then gone)."""
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                self.settings.argv(theirs.fileno()), pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self._lifeline = ours
        line = _read_report(ours, REPORT_TIMEOUT_S)
        kind, _, rest = line.partition(" ")
        if kind == "bound":
            port, _, url = rest.partition(" ")
            self.settings = _with_port(self.settings, int(port))
            return url
        self._end_child()
        raise ServeFailed(rest if kind == "error" else
                          "the exporter process exited before it reported a bind")

    def _supervise(self) -> None:
        try:
            self._first.append(self._spawn())
        except ServeFailed as e:
            self._first.append(e)
        except Exception as e:  # cannot start a process at all: said, never raised
            self._first.append(ServeFailed(f"cannot start the exporter process: {e}"))
        self._first_ready.set()
        if isinstance(self._first[0], ServeFailed):
            return
        delay = RESTART_DELAY_S
        while not self._stopping.is_set():
            process = self.process
            assert process is not None
            code = process.wait()  # blocks this thread only; nothing runs per step
            if self._stopping.is_set():
                return
            log.warning("kvmetrics: the metrics exporter process (pid %d) exited with %s; "
                        "starting it again", process.pid, code)
            self._close_lifeline()
            while not self._stopping.wait(delay):
                try:
                    url = self._spawn()
                except Exception as e:
                    delay = min(delay * 2, MAX_RESTART_DELAY_S)
                    log.error("kvmetrics: restarting the metrics exporter process failed "
                              "(%s); trying again in %g s", e, delay)
                    continue
                if self._stopping.is_set():  # stop() came while this one started
                    self._end_child()
                    return
                self.restarts += 1
                delay = RESTART_DELAY_S
                log.info("kvmetrics: serving metrics on %s again (exporter process pid %d, "
                         "restart %d)", url, self.pid, self.restarts)
                break

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def stop(self, timeout: float = 10.0) -> None:
        """End the child (EOF on its lifeline, then SIGKILL past ``timeout``) and, for a
        private directory, let it go (removed once no exporter of this process serves it)."""
        self._stopping.set()
        self._end_child(timeout)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self.settings.owns_directory:
            _release_directory(self.settings.directory)

    def _end_child(self, timeout: float = 10.0) -> None:
        self._close_lifeline()
        process = self.process
        if process is None:
            return
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _close_lifeline(self) -> None:
        """Close the engine's end. The byte sent first tells a child that is still
        there that the engine lives on (a stop, not a death): it keeps the directory."""
        if self._lifeline is not None:
            with contextlib.suppress(OSError):
                self._lifeline.send(ENGINE_LIVES, socket.MSG_NOSIGNAL)
            with contextlib.suppress(OSError):
                self._lifeline.close()
            self._lifeline = None


def start_serve_process(where: tuple[str, int], tls: TLSOptions | None,
                        labels: tuple[str, str] = ("default", "0")) -> ServeProcess:
    """Start the exporter of this engine on ``where`` and make this process write its
    values to the files it serves; ServeFailed (nothing changed, nothing left) when it
    cannot serve.

    The files are the user's ``PROMETHEUS_MULTIPROC_DIR`` if set, else this process's
    private directory (:class:`_PrivateDirectory`), removed with its last exporter.
    Call before the engine's sink makes its first metric.
    """
    directory, owns = _lease_directory()
    tls = tls or TLSOptions()
    child = ServeProcess(ChildSettings(directory, where[0], where[1], tls.certfile,
                                       tls.keyfile, tls.client_cafile, owns_directory=owns,
                                       labels=labels))
    try:
        child.start()
    except ServeFailed:
        child.stop()  # lets the directory go, too
        raise
    use_multiprocess_values(directory)
    return child


def _with_port(settings: ChildSettings, port: int) -> ChildSettings:
    """The same settings on the port bound: a restarted child keeps the address that
    scrapers and the port file know, also when port 0 was asked for."""
    return dataclasses.replace(settings, port=port)


def _read_report(sock: socket.socket, timeout: float) -> str:
    """The child's one report line, or "" when it exits or says nothing in time."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\n" not in data and len(data) < _MAX_REPORT_BYTES:
            chunk = sock.recv(_MAX_REPORT_BYTES - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:  # a timeout included
        return ""
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(None)
    return data.partition(b"\n")[0].decode("utf-8", "replace")
