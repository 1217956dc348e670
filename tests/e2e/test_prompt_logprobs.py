"""SamplingParams.prompt_logprobs: every prompt token's logprob, rank and top-k equal transformers' log_softmax,
whatever the chunking, batching, preemption or prefix caching."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams

# 30-odd tokens: several KV blocks (so the prefix cache has full blocks to offer) and, with a 7-token budget,
# five prefill chunks.
PROMPT = ("In a recent study of distributed systems, researchers compared consensus protocols under network "
          "partitions, measuring latency and throughput.")
OTHER = "The capital of France is"
TOP_K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
WITH_PROMPT_LP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP_K)


def hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def assert_matches_transformers(out, hf_model, num_top: int = TOP_K) -> None:
    ids = out.prompt_token_ids
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    ref = hf_log_softmax(hf_model, ids)
    worst = 0.0
    for i in range(1, len(ids)):
        row, entry = ref[i - 1], plp[i]
        # The row before token i predicts it: the prompt token itself plus the top-k, nothing else.
        top_ids = row.topk(num_top).indices.tolist()
        assert set(entry) == set(top_ids) | {ids[i]}, i
        ranked = sorted((lp.rank, tid) for tid, lp in entry.items() if tid in top_ids)
        assert [tid for _, tid in ranked] == top_ids, i  # ranks 1..k in transformers' topk order
        for tid, lp in entry.items():
            worst = max(worst, abs(lp.logprob - row[tid].item()))
            assert lp.decoded_token is not None
        assert entry[ids[i]].rank == int((row >= row[ids[i]]).sum())
    assert worst < 1e-4, f"max abs diff {worst}"


@pytest.fixture(scope="module")
def chunked():
    # A 7-token budget over 4-token blocks: the prompt takes several steps and chunks cross block edges.
    return LLM(kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=7, block_size=4)


def test_whole_prompt_matches_transformers(llm, hf_smol):
    [out] = llm.generate(PROMPT, WITH_PROMPT_LP, use_tqdm=False)
    assert_matches_transformers(out, hf_smol)


def test_chunked_prefill_in_a_mixed_batch_matches_transformers(chunked, hf_smol):
    outs = chunked.generate([OTHER, PROMPT, "Hi"], [GREEDY, WITH_PROMPT_LP, GREEDY], use_tqdm=False)
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    assert_matches_transformers(outs[1], hf_smol)
    # The requests without prompt logprobs answer exactly as alone.
    assert outs[0].outputs[0].token_ids == chunked.generate(OTHER, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_zero_top_k_and_one_token_prompt(llm, hf_smol):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    out, single = llm.generate([OTHER, {"prompt_token_ids": [504]}], params, use_tqdm=False)
    assert all(set(e) == {t} for e, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:]))
    assert_matches_transformers(out, hf_smol, num_top=0)
    assert single.prompt_logprobs == [None]


def test_prefix_cache_hits_are_not_taken(llm):
    # The first request fills the cache; a plain repeat hits it, a prompt-logprobs repeat must not.
    first = llm.generate(PROMPT + " Again.", WITH_PROMPT_LP, use_tqdm=False)[0]
    plain = llm.generate(PROMPT + " Again.", GREEDY, use_tqdm=False)[0]
    second = llm.generate(PROMPT + " Again.", WITH_PROMPT_LP, use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert second.num_cached_tokens == 0
    assert second.prompt_logprobs == first.prompt_logprobs
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == plain.outputs[0].token_ids


def test_preemption_by_recompute_does_not_duplicate(llm):
    prompts = [PROMPT, OTHER, "def add(a, b):\n    return", "Water is made of", "List three uses of paper clips:"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    ref = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(kv_cache_memory_bytes=16 << 20, num_gpu_blocks_override=14, block_size=4)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    for got, want in zip(outs, ref):
        assert len(got.prompt_logprobs) == len(got.prompt_token_ids)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert set(g) == set(w)
            assert all(g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4) for t in g)


def test_parallel_samples_share_one_prompt_logprobs(llm):
    alone = llm.generate(OTHER, WITH_PROMPT_LP, use_tqdm=False)[0]
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=3, prompt_logprobs=TOP_K)
    [out] = llm.generate(OTHER, params, use_tqdm=False)
    assert len(out.outputs) == 3
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for g, w in zip(out.prompt_logprobs[1:], alone.prompt_logprobs[1:]):
        assert set(g) == set(w)
        assert all(g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4) for t in g)
