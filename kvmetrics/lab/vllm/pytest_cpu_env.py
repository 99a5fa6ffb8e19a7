"""pytest plugin: run vLLM's own unit tests on a CPU without Triton.

``scripts/test-vllm-series.sh`` runs vLLM's ``tests/v1/kv_connector/unit`` and
``tests/v1/core`` from a release's sdist with ``-p
kvmetrics.lab.vllm.pytest_cpu_env``. From 0.34 on, vLLM's CPU platform
refuses to build a ``VllmConfig`` without Triton (triton-cpu), which these tests
never run a kernel of; for the whole session this plugin lets that one check pass,
exactly as the canaries do (:func:`~kvmetrics.lab.vllm.compat.cpu_config_context`).
Nothing else of vLLM is touched, and nothing is patched where the check does not apply.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

_session = ExitStack()


def pytest_configure(config: Any) -> None:
    from kvmetrics.lab.vllm.compat import cpu_config_context

    _session.enter_context(cpu_config_context())


def pytest_unconfigure(config: Any) -> None:
    _session.close()
