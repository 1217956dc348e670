"""Which drafter a SpeculativeConfig asks for."""
from __future__ import annotations

from pagedserve.config import SpeculativeConfig
from pagedserve.spec_decode.ngram_proposer import NgramProposer


def make_proposer(config: SpeculativeConfig | None) -> NgramProposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative method {config.method!r} is not supported yet")
