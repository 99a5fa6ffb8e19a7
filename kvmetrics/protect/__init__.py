"""The opt-in protective recovery: fixes vLLM's recovery-path defects, off by default.

``KVMETRICS_RECOVERY=evict`` (or ``additional_config["kvmetrics"]["recovery"]``) makes the
observer's scheduler (:mod:`kvmetrics.vllm.scheduler`) compose :class:`ProtectMixin` into
its class at construction; with the setting off the mixin is not in the class at all. It
ships into ``vllm serve`` with the observer and is the one part of kvmetrics that changes
vLLM's decisions. It may import the engine-agnostic core and the observer's hook table,
fingerprints and logger (:mod:`kvmetrics.vllm`), never the fault connector, the lab or the
commands.

- :mod:`.recovery`: the mixin, the setting and the hooks it checks at startup.

The names in ``__all__`` are imported on first use, so that importing this package never
imports vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RECOVERIES", "ProtectMixin", "protected_over", "recovery_setting"]


def __getattr__(name: str) -> Any:
    """The names of ``__all__``, from :mod:`.recovery`."""
    if name in __all__:
        from kvmetrics.protect import recovery

        return getattr(recovery, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
