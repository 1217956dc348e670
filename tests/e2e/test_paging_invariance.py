"""Greedy outputs must not depend on paging, batching, chunking, preemption or prefix caching."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Write a haiku about the ocean:",
    "List three uses of paper clips: 1.",
    "def add(a, b):\n    return",
    "The history of the Roman Empire begins with",
    "Water is made of",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("kwargs", [
    dict(num_gpu_blocks_override=12, block_size=4),                        # forces preemption
    dict(max_num_batched_tokens=7, block_size=4),                          # tiny chunks across blocks
    dict(max_num_seqs=1, enable_prefix_caching=False),                     # no batching
    dict(block_size=1, enable_chunked_prefill=False),
])
def test_greedy_is_invariant(reference, kwargs):
    llm = LLM(kv_cache_memory_bytes=16 << 20, **kwargs)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    engine = llm.llm_engine
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks
    if "num_gpu_blocks_override" in kwargs:
        assert engine.scheduler.num_preemptions_total > 0
