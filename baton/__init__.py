"""Baton: an LLM serving engine with disaggregated prefill and decode."""
from __future__ import annotations

import importlib

# Imported on first use, so that clients (`baton generate --target`, baton.services.client)
# start without loading torch and transformers.
_LAZY = {"LLM": "baton.engine.offline.llm", "RequestOutput": "baton.engine.offline.llm",
         "CompletionOutput": "baton.engine.offline.llm", "SamplingParams": "baton.engine.common.sampling_params"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'baton' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
