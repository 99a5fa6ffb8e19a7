"""Where the instrumented scheduler's metrics go, configured without touching vLLM's CLI.

The scheduler runs in vLLM's EngineCore process, not in the API server that serves
vLLM's own ``/metrics``, so by default it serves its own scrape endpoint. Settings
come from environment variables (inherited by EngineCore processes) and can be
overridden per engine with ``--additional-config '{"kvmetrics": {...}}'``.

The table of settings, with each one's kind and range, is :data:`SETTINGS`
(:mod:`kvmetrics.metrics.settings`; docs/user-guide.md shows it). Every value is
checked by its kind before use: a string where a string belongs, a flag that is a
boolean or a documented spelling (``"false"`` is false, ``"maybe"`` is refused), a
number inside its range.

An unknown key under ``additional_config["kvmetrics"]`` stops the engine at startup
with one line naming it: a misspelt ``recovery`` must not leave a replica silently
unprotected. So do a ``metrics_addr`` that is not ``HOST:PORT`` (an operator who
typed ``http://host:9401`` must learn it at once, not find an engine that exports
nothing), a ``model_name`` or ``engine`` that cannot be a label value (not
UTF-8, too long, a control, bidirectional or invisible character: every scrape would
fail, or a dashboard show spoofed text) and TLS files that cannot be loaded (the
operator asked for an encrypted endpoint; serving none, or plain HTTP, would be a lie).
Only a value someone set is refused: the default ``model_name`` comes from vLLM's
served model name, which is the model path unless ``--served-model-name`` is given,
and a path is often longer than a label may be (a Hugging Face snapshot path is). It
is made a valid label instead (:func:`~kvmetrics.metrics.labels.model_label`): a
snapshot path as its repository id, any other too-long value as its last path
components and a hash.

An address that is well formed but cannot be bound (a port in use, a privileged
port, a host name that does not resolve) is another matter: it can be a transient
clash on a shared host, and the engine serves requests either way. It gets one error
line naming the address and the reason, and the engine runs on without the endpoint;
nothing announces an endpoint before it is bound (the "serving metrics on" line and
the port file come after the bind).

With ``PROMETHEUS_MULTIPROC_DIR`` set the values are written to that shared
directory instead (the one vLLM's API server reads when it is set before
``vllm serve`` starts), and no endpoint of our own is started unless
``KVMETRICS_METRICS_ADDR`` is given explicitly.
"""

from __future__ import annotations

import multiprocessing
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmetrics.exporters.process import (
    ServeFailed,
    ServeProcess,
    own_private_directory,
    start_serve_process,
)
from kvmetrics.exporters.prometheus import (
    MetricsServer,
    PrometheusSink,
    multiprocess_dir,
    parse_host_port,
    serve,
)
from kvmetrics.exporters.tls import TLSOptions, tls_context
from kvmetrics.metrics.files import FileRefused, write_file
from kvmetrics.metrics.labels import check_label_value, model_label
from kvmetrics.metrics.logs import get_logger
from kvmetrics.metrics.pipeline import MetricsPipeline
from kvmetrics.metrics.settings import SETTINGS, check_additional_config, check_env, flag
from kvmetrics.metrics.sink import MetricSink
from kvmetrics.metrics.text import short_text

#: Under vLLM's own logger: in ``vllm serve`` that one has the handler (vLLM configures
#: it with ``propagate=False`` and leaves the root logger bare), so kvmetrics' lines reach
#: the server's log in vLLM's format, with the EngineCore process prefix.
LOGGER = "vllm.kvmetrics"
log = get_logger(LOGGER)  # shared by the vLLM-side modules: escaped once here

DEFAULT_METRICS_ADDR = "127.0.0.1:9401"
_OFF = ("", "off", "none", "0", "false", "no")
#: Where ``/metrics`` is served from: the EngineCore itself, or a process of its own.
SERVE_MODES = ("engine", "process")


def default_serve_mode() -> str:
    """``process`` where the EngineCore runs in a process of its own (``vllm serve``
    starts it with multiprocessing), ``engine`` where vLLM runs it inside the caller's
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, tests, the lab): serving from another
    process sets ``PROMETHEUS_MULTIPROC_DIR`` and prometheus-client's value class for
    the whole process, which kvmetrics does only in a process vLLM made for the engine."""
    return "engine" if multiprocessing.parent_process() is None else "process"


@dataclass
class ExportSettings:
    metrics_addr: str | None = DEFAULT_METRICS_ADDR
    model_name: str = "default"
    engine: str = "0"
    #: Data-parallel index: added to the endpoint's port.
    port_offset: int = 0
    strict: bool = False
    otlp_endpoint: str | None = None
    export: bool = True
    #: The recovery path the scheduler runs (``KVMETRICS_RECOVERY``), for the build info.
    recovery: str = "vllm"
    #: The running vLLM for the build info: version, verified ("true"/"false"), the
    #: fingerprints that differ from the verified record (comma-separated).
    vllm: tuple[str, str, str] = ("", "", "")
    extra_sinks: list[MetricSink] = field(default_factory=list)
    tls: TLSOptions | None = None
    #: Families this vLLM cannot compute (an unusable hook): never on the page.
    absent_families: frozenset[str] = frozenset()
    #: One of :data:`SERVE_MODES` (as set: :func:`check_setting_keys` refuses others).
    serve: str = "engine"


#: Every key ``additional_config["kvmetrics"]`` may hold.
SETTING_KEYS = tuple(s.key for s in SETTINGS if s.key)


def check_setting_keys(vllm_config: Any) -> None:
    """Raise ValueError (one line) for a setting that cannot work: a key of
    ``additional_config["kvmetrics"]`` that kvmetrics does not know, a metrics address
    that is not ``HOST:PORT``, a label value that cannot be served, or TLS files that
    cannot be loaded."""
    _check_keys(vllm_config)
    check_env(os.environ)
    settings = settings_for(vllm_config)
    if settings.metrics_addr is not None:
        check_metrics_addr(settings.metrics_addr, _addr_setting_name(vllm_config))
    check_label_value("kvmetrics model_name (KVMETRICS_MODEL_NAME)", settings.model_name)
    check_label_value("kvmetrics engine (KVMETRICS_ENGINE)", settings.engine)
    if settings.serve not in SERVE_MODES:
        shown = settings.serve[:_SHOWN_CHARS]
        raise ValueError(f"kvmetrics: serve (KVMETRICS_SERVE) must be one of "
                         f"{', '.join(SERVE_MODES)}, got {shown!r}")
    if settings.tls is not None:
        if settings.metrics_addr is None or not settings.export:
            raise ValueError("kvmetrics TLS settings given, but no kvmetrics endpoint is "
                             "served (KVMETRICS_METRICS_ADDR is off or multiprocess mode)")
        tls_context(settings.tls)  # TLSConfigError, a ValueError: one line


#: A host as ``HOST:PORT`` may carry it: a name or IPv4 address, or an IPv6 address
#: (bracketed, or bare as :func:`parse_host_port` reads it). A scheme or a path is not.
_HOST = re.compile(r"[A-Za-z0-9._-]*|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]+")
_SHOWN_CHARS = 80
#: The longest host name DNS can resolve (253 characters, dotted) with room for brackets.
_MAX_HOST_CHARS = 255


def check_metrics_addr(value: Any, setting: str = "KVMETRICS_METRICS_ADDR") -> None:
    """Raise ValueError, one line naming ``setting``, the value (cut to 80 characters)
    and the form expected, unless ``value`` is ``HOST:PORT`` with a port of 0-65535."""
    text = value if isinstance(value, str) else None
    try:
        if text is None:
            raise ValueError("not a string")
        host = text.rpartition(":")[0]
        parse_host_port(text)
        if len(host) > _MAX_HOST_CHARS or not _HOST.fullmatch(host):
            raise ValueError("not a host")
    except ValueError:
        shown = short_text(value, _SHOWN_CHARS) if isinstance(value, str) else type(value).__name__
        raise ValueError(f"kvmetrics: {setting}={shown!r} is not an address to serve metrics "
                         "on: expected HOST:PORT with a port from 0 to 65535 (e.g. "
                         "127.0.0.1:9401, 0.0.0.0:9401, [::1]:9401), or off") from None


def _addr_setting_name(vllm_config: Any) -> str:
    """Where the metrics address in force comes from, named as the operator set it."""
    extra = getattr(vllm_config, "additional_config", None)
    ours = extra.get("kvmetrics") if isinstance(extra, dict) else None
    if isinstance(ours, dict) and "metrics_addr" in ours:
        return "additional_config.kvmetrics.metrics_addr"
    return "KVMETRICS_METRICS_ADDR"


def _check_keys(vllm_config: Any) -> None:
    extra = getattr(vllm_config, "additional_config", None)
    ours = extra.get("kvmetrics") if isinstance(extra, dict) else None
    if ours is None:
        return
    if not isinstance(ours, dict):
        raise ValueError(f"additional_config.kvmetrics must be an object, got {ours!r}")
    unknown = sorted(set(ours) - set(SETTING_KEYS))
    if unknown:
        raise ValueError(f"additional_config.kvmetrics: unknown setting "
                         f"{short_text(unknown[0], 40)!r} (known: {', '.join(SETTING_KEYS)})")
    check_additional_config(ours)


def _flag(name: str, value: Any, default: bool) -> bool:
    """A flag as :func:`check_setting_keys` accepts it; ``default`` for one it refuses,
    with the refusal logged (settings built without that check, as a test does, never
    raise here, and never take a default silently)."""
    if isinstance(value, str) and not value.strip():
        return default
    try:
        return flag(name, value)
    except ValueError as e:
        log.warning("%s; using %s", e, default)
        return default


def settings_for(vllm_config: Any, env: Mapping[str, str] | None = None) -> ExportSettings:
    """Export settings of one engine: env vars, then additional_config overrides."""
    env = os.environ if env is None else env
    dp_index = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
    model = vllm_config.model_config
    served = getattr(model, "served_model_name", None)
    if isinstance(served, list | tuple):
        served = served[0] if served else None
    # Set by no one: derived, never refused (check_setting_keys checks the rest).
    derived_model_name = model_label(served, getattr(model, "model", None))
    values: dict[str, Any] = {
        "metrics_addr": env.get("KVMETRICS_METRICS_ADDR"),
        "model_name": env.get("KVMETRICS_MODEL_NAME") or derived_model_name,
        "engine": env.get("KVMETRICS_ENGINE") or str(dp_index),
        "strict": env.get("KVMETRICS_STRICT", "0"),
        "otlp_endpoint": env.get("KVMETRICS_OTLP_ENDPOINT") or None,
        "export": env.get("KVMETRICS_EXPORT", "1"),
        "tls_cert": env.get("KVMETRICS_TLS_CERT") or None,
        "tls_key": env.get("KVMETRICS_TLS_KEY") or None,
        "tls_client_ca": env.get("KVMETRICS_TLS_CLIENT_CA") or None,
        "serve": env.get("KVMETRICS_SERVE") or default_serve_mode(),
    }
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and isinstance(extra.get("kvmetrics"), dict):
        # null: not set here (the environment's value stands).
        values.update({k: v for k, v in extra["kvmetrics"].items()
                       if k in values and v is not None})
    tls = TLSOptions(certfile=values["tls_cert"] or None, keyfile=values["tls_key"] or None,
                     client_cafile=values["tls_client_ca"] or None)
    addr = values["metrics_addr"]
    if addr is None:
        users_dir = multiprocess_dir() not in (None, own_private_directory())
        addr = None if users_dir else DEFAULT_METRICS_ADDR
    elif str(addr).strip().lower() in _OFF:
        addr = None
    return ExportSettings(
        metrics_addr=addr,
        model_name=str(values["model_name"]),
        engine=str(values["engine"]),
        port_offset=dp_index,
        strict=_flag("strict", values["strict"], False),
        otlp_endpoint=values["otlp_endpoint"] or None,
        export=_flag("export", values["export"], True),
        tls=tls if tls.enabled else None,
        serve=str(values["serve"]).strip().lower(),
    )


@dataclass
class Exporter:
    """The pipeline of one engine plus what must be shut down with it."""

    pipeline: MetricsPipeline
    prometheus: PrometheusSink
    server: MetricsServer | None = None
    otel_provider: Any = None
    #: ``serve=process``: the supervised exporter process serving this engine's files.
    serve_process: ServeProcess | None = None

    def shutdown(self) -> None:
        try:
            self.prometheus.close()  # multiprocess mode: this engine's live gauges go
        except Exception:
            log.exception("kvmetrics: marking this process dead failed")
        if self.server is not None:
            try:
                self.server.stop()
            except Exception:
                log.exception("kvmetrics: stopping the metrics endpoint failed")
            self.server = None
        if self.serve_process is not None:
            try:
                self.serve_process.stop()
            except Exception:
                log.exception("kvmetrics: stopping the metrics exporter process failed")
            self.serve_process = None
        if self.otel_provider is not None:
            try:
                from kvmetrics.exporters.otel import SHUTDOWN_TIMEOUT_S, shutdown_provider

                if not shutdown_provider(self.otel_provider):
                    log.warning("kvmetrics: the OTLP collector did not take the last push "
                                "within %g s; it was dropped", SHUTDOWN_TIMEOUT_S)
            except Exception:
                log.exception("kvmetrics: stopping the OTLP exporter failed")
            self.otel_provider = None


def endpoint_for(settings: ExportSettings) -> tuple[str, int] | None:
    """Host and port to serve; port 0 (any free port) gets no data-parallel offset."""
    if settings.metrics_addr is None:
        return None
    host, port = parse_host_port(settings.metrics_addr)
    if port:
        port += settings.port_offset
    return host, port


def _write_port_file(port: int) -> None:
    """With ``KVMETRICS_METRICS_PORT_FILE`` set, write the port actually bound there.

    For ``metrics_addr`` port 0 (any free port): whoever scrapes learns the port from
    the engine that bound it, instead of picking a free port beforehand and hoping
    that nothing else takes it before the EngineCore binds it, a minute later.
    """
    path = os.environ.get("KVMETRICS_METRICS_PORT_FILE")
    if not path:
        return
    try:
        # An exclusive temp file of a random name, renamed over the name itself: nothing
        # planted at a predictable name can redirect the write, and a link, a device, a
        # directory or another user's file at PATH is refused rather than followed or
        # replaced (an engine runs as root; PATH may be in a shared /tmp).
        write_file(path, f"{port}\n", no_follow=True)
    except FileRefused as e:
        log.error("kvmetrics: cannot write KVMETRICS_METRICS_PORT_FILE: %s", short_text(str(e)))
    except OSError as e:
        log.error("kvmetrics: cannot write KVMETRICS_METRICS_PORT_FILE %s: %s",
                  short_text(path), e.strerror or type(e).__name__)


def build_exporter(settings: ExportSettings) -> Exporter:
    """A pipeline with a Prometheus sink (own registry), its endpoint and OTLP if asked.

    A busy port or an unreachable collector is logged, never raised: the engine
    must come up even if its metrics cannot be exported.
    """
    where, child = _where(settings), None
    if where is not None and settings.serve == "process":
        # Before the sink makes its first metric: its values must go to the files.
        child = _start_serve_process(where, settings.tls,
                                     (settings.model_name, settings.engine))
        where = None
    sink = PrometheusSink()
    sinks: list[MetricSink] = [sink, *settings.extra_sinks]
    provider = None
    if settings.otlp_endpoint:
        try:
            from kvmetrics.exporters.otel import make_provider, otlp_reader, sink_for

            provider = make_provider([otlp_reader(settings.otlp_endpoint)],
                                     model_name=settings.model_name, engine=settings.engine,
                                     engine_kind="vllm")
            sinks.append(sink_for(provider))
        except Exception:
            log.exception("kvmetrics: OTLP export to %s disabled",
                          short_text(settings.otlp_endpoint))
    pipeline = MetricsPipeline(sinks, model_name=settings.model_name, engine=settings.engine,
                               engine_kind="vllm", recovery=settings.recovery,
                               vllm=settings.vllm,
                               strict=settings.strict, absent=settings.absent_families)
    exporter = Exporter(pipeline, sink, otel_provider=provider, serve_process=child)
    if where is not None:
        exporter.server = _bind(sink, where, settings.tls)
    return exporter


def _where(settings: ExportSettings) -> tuple[str, int] | None:
    try:
        return endpoint_for(settings)
    except ValueError as e:  # refused at startup by check_setting_keys; built directly here
        log.error("kvmetrics: %s; this engine runs on without a kvmetrics endpoint", e)
        return None


def _start_serve_process(where: tuple[str, int], tls: TLSOptions | None,
                         labels: tuple[str, str]) -> ServeProcess | None:
    """The exporter process, announced only once it has bound; None, with one error
    line, when it cannot serve (the engine then records in memory, as with no endpoint)."""
    try:
        child = start_serve_process(where, tls, labels)
    except ServeFailed as e:
        _log_bind_error(_shown(*where), str(e))
        return None
    log.info("kvmetrics: serving metrics on %s (exporter process pid %s)", child.url, child.pid)
    _write_port_file(child.settings.port)
    return child


def _shown(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _log_bind_error(shown: str, reason: str) -> None:
    """One line, whatever the address: each value in it is cut short once."""
    shown, reason = short_text(shown, _SHOWN_CHARS), short_text(reason.replace(shown, "ADDR"))
    log.error("kvmetrics: cannot serve metrics on %s: %s; this engine runs on without a "
              "kvmetrics endpoint (free it, or set KVMETRICS_METRICS_ADDR to one it can "
              "bind)", shown, reason)


def _bind(sink: PrometheusSink, where: tuple[str, int],
          tls: TLSOptions | None) -> MetricsServer | None:
    """The endpoint, announced (log line, port file) only once it is bound; None, with
    one error line naming the address and the reason, when it cannot be bound."""
    host, port = where
    shown = _shown(host, port)
    try:
        server = serve(sink.serving_registry(), host, port, tls=tls)
    except (OSError, OverflowError) as e:  # in use, not allowed, no such host, port > 65535
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        # socket.create_server repeats the address after the reason: said once is enough.
        reason = reason.split(" (while attempting to bind", 1)[0]
        _log_bind_error(shown, reason)
        return None
    except Exception:  # a fault of kvmetrics' own: its traceback is the report
        log.exception("kvmetrics: cannot serve metrics on %s; this engine runs on without a "
                      "kvmetrics endpoint", short_text(shown, _SHOWN_CHARS))
        return None
    log.info("kvmetrics: serving metrics on %s", server.url)
    _write_port_file(server.port)
    return server
