"""Draft-model speculation on the embedded model with itself as the draft: greedy output token-identical to
the plain engine (the session's `llm`), and the drafts accepted."""
from __future__ import annotations

from pagedserve import LLM, SamplingParams
from pagedserve.model.loader import default_model_path
from tests.e2e.conftest import KV_BYTES
from tests.e2e.test_spec_decode import table_prompts
from tests.spec_decode.test_draft_model import draft_config


def test_self_draft_of_the_embedded_model_is_exact_and_accepted(llm):
    prompts = table_prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    off = llm.generate(prompts, params, use_tqdm=False)
    # The budget holds the draft's KV cache too (the same size as the target's here).
    spec_llm = LLM(kv_cache_memory_bytes=KV_BYTES // 2, max_num_batched_tokens=256, max_num_seqs=8,
                   speculative_config=draft_config(default_model_path(), k=3))
    on = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    core = spec_llm.llm_engine.core
    spec = core.stats.spec
    # The draft is the target: every draft is the target's argmax, up to batched-numerics ties.
    assert spec.num_draft_tokens >= 4 * 3 and spec.acceptance_rate > 0.9
    assert core.kv.pool.num_free_blocks == core.num_kv_blocks
