"""Every ``KVMETRICS_*`` setting of a vLLM engine: its name, kind and range, and the
one-line refusal of a value that cannot work.

An engine's settings come from environment variables (inherited by every EngineCore)
and from ``--additional-config '{"kvmetrics": {...}}'`` (JSON, so any type). Each is
checked here, by its kind, before anything uses it, because a value of the wrong
kind fails far from where it was set: ``tls_cert: 5`` is a ``TypeError`` deep in
``ssl``, the string ``"false"`` is true to Python, ``KVMETRICS_SCRAPE_RATE=1e-300``
would serve one page and then nothing, and ``KVMETRICS_SCRAPE_MAX_AGE_S=1e300`` would
freeze the page for good.

The rules:

- **text** (an address, a label, a path, a URL, a choice): a string; in
  ``additional_config`` JSON ``null`` means "not set here".
- **flag**: a JSON ``true``/``false``, or one of the spellings in :data:`TRUE_WORDS`
  and :data:`FALSE_WORDS` (any case); anything else (``"maybe"``, ``2``) is refused.
- **number**: a finite decimal number inside the setting's range (or exactly ``0``
  where ``0`` has a meaning of its own); NaN, infinities, negatives and values past
  the range are refused with the variable and the range named.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmetrics.metrics.text import short_repr

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One setting: where it is set and what it accepts."""

    #: The environment variable (None: only in ``additional_config``).
    env: str | None
    #: The ``additional_config["kvmetrics"]`` key (None: environment only).
    key: str | None
    #: ``text``, ``flag`` or ``number``.
    kind: str
    #: What it does, for the settings table.
    meaning: str
    #: For a number: the smallest and largest value accepted.
    low: float = 0.0
    high: float = 0.0
    #: For a number: ``0`` is accepted outside the range and means this.
    zero_means: str | None = None

    def range_text(self) -> str:
        """The accepted range as the refusal line and the user guide say it."""
        span = f"a number from {self.low:g} to {self.high:g}"
        return f"0 ({self.zero_means}) or {span}" if self.zero_means else span

    def accepts(self, value: float) -> bool:
        if value == 0 and self.zero_means:
            return True
        return self.low <= value <= self.high  # NaN fails both bounds


#: The table of settings (docs/user-guide.md shows it with the ranges).
SETTINGS: tuple[Setting, ...] = (
    Setting("KVMETRICS_METRICS_ADDR", "metrics_addr", "text",
            "HOST:PORT to serve (``off`` serves none); data-parallel rank r serves PORT+r"),
    Setting("KVMETRICS_MODEL_NAME", "model_name", "text", "the ``model_name`` label"),
    Setting("KVMETRICS_ENGINE", "engine", "text", "the ``engine`` label"),
    Setting("KVMETRICS_STRICT", "strict", "flag", "raise on counter violations (tests)"),
    Setting("KVMETRICS_OTLP_ENDPOINT", "otlp_endpoint", "text", "also push OTLP/HTTP here"),
    Setting("KVMETRICS_EXPORT", "export", "flag",
            "false: build no pipeline (the owner drains the step events)"),
    Setting("KVMETRICS_RECOVERY", "recovery", "text", "``vllm`` or ``evict``"),
    Setting("KVMETRICS_TLS_CERT", "tls_cert", "text", "PEM certificate: serve HTTPS"),
    Setting("KVMETRICS_TLS_KEY", "tls_key", "text", "its PEM private key (unencrypted)"),
    Setting("KVMETRICS_TLS_CLIENT_CA", "tls_client_ca", "text",
            "require client certificates signed by this CA"),
    Setting("KVMETRICS_METRICS_PORT_FILE", None, "text", "write the port bound there"),
    Setting("KVMETRICS_SERVE", "serve", "text",
            "``process`` (default where the EngineCore has a process of its own, as "
            "under ``vllm serve``): a supervised exporter process serves; ``engine`` "
            "(default where vLLM runs the engine in the caller's process): the "
            "EngineCore serves"),
    Setting("KVMETRICS_SCRAPE_MAX_AGE_S", None, "number",
            "collect the page at most once per this many seconds", 0.0, 600.0),
    Setting("KVMETRICS_SCRAPE_RATE", None, "number",
            "requests answered per second, all clients together", 0.1, 10000.0,
            zero_means="no bound"),
)
BY_ENV = {s.env: s for s in SETTINGS if s.env}
BY_KEY = {s.key: s for s in SETTINGS if s.key}


def number(setting: Setting, text: str) -> float:
    """The value of a numeric setting read from the environment, or ValueError (one
    line naming the variable, the value cut short, and the range)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not setting.accepts(value):
        raise ValueError(f"kvmetrics: {setting.env}={short_repr(text, 40)} is not "
                         f"{setting.range_text()}")
    return value


def flag(name: str, value: Any) -> bool:
    """A flag's value, or ValueError naming ``name``: a real boolean or a documented
    spelling, never the truth of an arbitrary string (``bool("false")`` is True)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ValueError(f"kvmetrics: {name}={short_repr(value, 40)} is not a flag: expected "
                     f"true or false ({'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)})")


def check_env(env: Mapping[str, str]) -> None:
    """ValueError (one line) for the first ``KVMETRICS_*`` variable of the table whose
    value its kind refuses; an unset or empty variable is the default."""
    for setting in SETTINGS:
        text = env.get(setting.env or "")
        if text is None or not text.strip():
            continue
        if setting.kind == "number":
            number(setting, text)
        elif setting.kind == "flag":
            flag(setting.env or "", text)


def check_additional_config(values: Mapping[str, Any]) -> None:
    """ValueError (one line naming ``additional_config.kvmetrics.KEY``) for a value of
    the wrong type: a flag that is not a boolean or a documented spelling, a text
    setting that is not a string. Unknown keys are the caller's to refuse."""
    for key, value in values.items():
        setting = BY_KEY.get(key)
        if setting is None or value is None:
            continue
        name = f"additional_config.kvmetrics.{key}"
        if setting.kind == "flag":
            flag(name, value)
        elif not isinstance(value, str):
            raise ValueError(f"kvmetrics: {name} must be a string, got "
                             f"{type(value).__name__} {short_repr(value, 40)}")
