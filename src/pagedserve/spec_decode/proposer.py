"""Which token-id drafter a SpeculativeConfig asks for (the draft model runs in the worker instead)."""
from __future__ import annotations

from pagedserve.config import SpeculativeConfig
from pagedserve.spec_decode.ngram_proposer import NgramProposer


def make_proposer(config: SpeculativeConfig | None) -> NgramProposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    return None  # draft_model: the engine gives the runner a DraftModel, which proposes inside each step
