"""Structured outputs beside n-gram speculation: requests under a grammar decode without drafts (their matcher
advances on emitted tokens only) while the others in the same batch keep drafting."""
from __future__ import annotations

import gc
import json

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams
from tests.server.helpers import ENGINE_KWARGS

SCHEMA = {"type": "object", "properties": {"store": {"type": "integer", "minimum": 1, "maximum": 99},
                                           "open": {"type": "boolean"}},
          "required": ["store", "open"], "additionalProperties": False}


def test_grammar_requests_beside_drafting_requests() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": None}
    llm = LLM(**{**ENGINE_KWARGS, "speculative_config": spec})
    try:
        quote = "Copy this list exactly: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10"
        free = SamplingParams(max_tokens=24, temperature=0)
        constrained = SamplingParams(max_tokens=40, temperature=0,
                                     structured_outputs=StructuredOutputsParams(json=SCHEMA))
        outs = llm.generate([quote, "Store 12 is open. As JSON:", quote, "Store 7 is closed. As JSON:"],
                            [free, constrained, free, constrained])
        for out in (outs[1], outs[3]):
            value = json.loads(out.outputs[0].text)
            assert set(value) == {"store", "open"} and 1 <= value["store"] <= 99
            assert out.outputs[0].finish_reason == "stop"
        # The free requests still speculated, and their greedy text equals a run without speculation.
        stats = llm.llm_engine.core.stats.spec
        assert stats.num_drafts > 0
        plain = LLM(**ENGINE_KWARGS)
        try:
            ref = plain.generate([quote], free)[0].outputs[0].text
        finally:
            del plain
        assert outs[0].outputs[0].text == ref == outs[2].outputs[0].text
    finally:
        del llm
        gc.collect()
