"""What differs between the vLLM versions the lab drives, in one place.

The lab plays vLLM's worker and builds vLLM's configuration itself, so it meets the
parts of vLLM's interface that change between releases and that a real ``vllm serve``
never asks kvmetrics about:

- **The CPU platform's Triton check (vLLM 0.34).** ``CpuPlatform.check_and_update_config``
  raises ``RuntimeError: vLLM on x86 CPUs requires Triton (triton-cpu)`` where 0.33
  logged a warning. triton-cpu is not on PyPI, and nothing the scheduler does needs
  Triton (it runs no kernel), so :func:`cpu_config_context` lets that one check pass
  while the lab builds a :class:`VllmConfig`; the rest of vLLM's platform check runs
  unchanged (docs/vllm-research.md says exactly what is bypassed). It lives here, in the lab's
  harness, so that nothing shipped into ``vllm serve`` ever applies it.
- **``ModelRunnerOutput.req_id_to_index``** is gone in 0.34 (vLLM derives it):
  :func:`runner_output` passes it only where the field exists.
- **Resumed requests.** Up to 0.33 a request resumed after preemption comes back in
  ``CachedRequestData`` and is named in its ``resumed_req_ids``; from 0.34 it is re-sent
  in ``scheduled_new_reqs`` with its whole token list (``prefill_token_ids``), like a new
  one. :func:`resumed_req_ids` and :func:`new_request_outputs` read either form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: The message of the check :func:`cpu_config_context` lets pass (vLLM 0.34).
TRITON_CHECK_MESSAGE = "requires Triton"


def triton_check_applies() -> bool:
    """Whether building a config here would hit the CPU platform's Triton check.

    True only on vLLM's CPU platform without Triton, on a vLLM whose check raises
    (0.34 on): on 0.33 the same condition only logged, and nothing is patched there.
    """
    import inspect

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm.triton_utils as triton_utils

    if triton_utils.HAS_TRITON:
        return False
    try:
        source = inspect.getsource(type(current_platform).check_and_update_config)
    except (OSError, TypeError):
        return False
    return TRITON_CHECK_MESSAGE in source and "raise RuntimeError" in source


@contextmanager
def cpu_config_context() -> Iterator[None]:
    """Build vLLM configs on a CPU without Triton, inside this block only.

    While vLLM's ``CpuPlatform.check_and_update_config`` runs (and only then), the
    module attribute ``vllm.triton_utils.HAS_TRITON`` reads True, which is what that
    method's first lines import to decide whether to raise. Everything else the method
    does (block sizes, compilation settings, environment variables for the CPU
    executor) runs as vLLM wrote it; no scheduler code reads the flag. The method is
    restored when the block ends, and nothing is patched where the check does not
    apply (:func:`triton_check_applies`).
    """
    if not triton_check_applies():
        yield
        return
    import vllm.triton_utils as triton_utils
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    original = platform_cls.__dict__["check_and_update_config"]
    func = original.__func__

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        saved = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            func(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = saved

    # method-assign, assignment: the lab's patch of vLLM's platform, undone below.
    platform_cls.check_and_update_config = classmethod(  # type: ignore[method-assign,assignment]
        check_and_update_config)
    try:
        yield
    finally:
        platform_cls.check_and_update_config = original  # type: ignore[method-assign]  # undoes the patch


def runner_output(**fields: Any) -> Any:
    """vLLM's ``ModelRunnerOutput`` from ``fields``; ``req_id_to_index`` is dropped on a
    vLLM that no longer has it (0.34 on), and derived from ``req_ids`` where it is
    required and not given."""
    from vllm.v1.outputs import ModelRunnerOutput

    names = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    if "req_id_to_index" in names:
        fields.setdefault("req_id_to_index",
                          {rid: i for i, rid in enumerate(fields.get("req_ids", ()))})
    else:
        fields.pop("req_id_to_index", None)
    return ModelRunnerOutput(**fields)


def resumed_req_ids(cached: Any) -> set[str] | frozenset[str]:
    """The requests of ``CachedRequestData`` resumed from preemption (none from 0.34 on,
    where a resumed request is sent in ``scheduled_new_reqs``)."""
    return getattr(cached, "resumed_req_ids", None) or frozenset()


def new_request_outputs(new: Any, num_prompt_tokens: int) -> int:
    """Output tokens a request in ``scheduled_new_reqs`` already has: 0 for a new request;
    from 0.34 on, a resumed one is sent there with its outputs in ``prefill_token_ids``."""
    tokens = getattr(new, "prefill_token_ids", None)
    if tokens is None:
        return 0
    return max(0, len(tokens) - num_prompt_tokens)
