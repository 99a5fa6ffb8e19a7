"""vLLM's ExampleConnector with a pause before the loads of marked prompts.

An abort is applied between a step's forward pass and the processing of its
output (``EngineCore.step``: ``_process_aborts_queue`` right before
``update_from_output``). On a tiny CPU model that pass takes milliseconds, too
short for a client to disconnect inside it on purpose. This subclass sleeps
``SLOW_S`` on the worker before it loads a prompt whose first token is
``SLOW_MARK`` (an id the other tests' prompts never use), so that a test can
disconnect the client while the load's step runs. It loads and saves as
ExampleConnector does, except that, like tests/helpers/load_only_connector.py, it
never saves a prompt carrying ``LOAD_ONLY_MARK`` (for the aborted sharer, whose
retry must come from vLLM's prefix cache, not from the store);
tests/test_serve_defects.py runs it inside FaultInjectingConnector
(``inner_module_path`` points here).
"""

from __future__ import annotations

import time
from typing import Any

from tests.helpers.load_only_connector import LoadOnlyExampleConnector

#: Token id that marks a prompt whose loads are slowed (greedy prompts use 3..1002).
SLOW_MARK = 1010
SLOW_S = 3.0


class SlowExampleConnector(LoadOnlyExampleConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if any(not r.is_store and len(r.token_ids) and int(r.token_ids[0]) == SLOW_MARK
               for r in getattr(meta, "requests", ())):
            time.sleep(SLOW_S)
        super().start_load_kv(forward_context, **kwargs)
