"""pagedserve: an LLM serving engine built on PagedAttention."""
from pagedserve.config import EngineConfig
from pagedserve.llm import LLM
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "EngineConfig"]
__version__ = "0.1.0"
