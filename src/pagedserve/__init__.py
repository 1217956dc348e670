"""pagedserve: an LLM serving engine built on PagedAttention."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "EngineConfig",
           "EngineArgs", "RequestOutputKind"]

# Imported on first use, so `import pagedserve.core...` stays free of torch (a test checks it).
_WHERE = {"LLM": "pagedserve.llm", "SamplingParams": "pagedserve.sampling_params",
          "BeamSearchParams": "pagedserve.sampling_params", "RequestOutput": "pagedserve.outputs",
          "CompletionOutput": "pagedserve.outputs", "EngineConfig": "pagedserve.config",
          "EngineArgs": "pagedserve.engine.arg_utils", "RequestOutputKind": "pagedserve.sampling_params"}

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.llm import LLM
    from pagedserve.outputs import CompletionOutput, RequestOutput
    from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
