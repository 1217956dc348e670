"""Sharing must never change outputs: prefix caching on/off, swapping under a tiny pool, n=4 vs 4 requests."""
from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def token_prompts(prefix_len: int, rng: random.Random) -> list[list[int]]:
    # Plain-text token ids (no specials) so the model sees ordinary input.
    prefix = [rng.randint(300, 20000) for _ in range(prefix_len)]
    return [prefix + [rng.randint(300, 20000) for _ in range(rng.randint(1, 20))] for _ in range(3)]


@pytest.fixture(scope="module")
def no_cache():
    return LLM(kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False)


@pytest.mark.parametrize("prefix_len", [0, 1, 15, 16, 17, 100])
def test_prefix_caching_keeps_greedy_outputs(llm, no_cache, prefix_len):
    prompts = [{"prompt_token_ids": p} for p in token_prompts(prefix_len, random.Random(prefix_len))]
    # The first prompt runs alone so the others can hit its cached blocks.
    cached = llm.generate(prompts[:1], GREEDY, use_tqdm=False) + llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    plain = no_cache.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    hits = [o.num_cached_tokens for o in cached[1:]]
    assert hits == [prefix_len // 16 * 16] * 2
    assert no_cache.llm_engine.scheduler.stats().prefix_cache_hits == 0


def test_swapping_under_a_tiny_pool_keeps_greedy_outputs(llm):
    prompts = ["The quick brown fox", "Write a haiku about the ocean:", "List three uses of paper clips: 1.",
               "def add(a, b):\n    return"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    swap = LLM(num_gpu_blocks_override=12, block_size=4, swap_space=0.01, preemption_mode="swap")
    outs = swap.generate(prompts, params, use_tqdm=False)
    ref = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    stats = swap.llm_engine.scheduler.stats()
    assert stats.num_preemptions_swap_total > 0
    assert stats.num_swapped_out_blocks_total == stats.num_swapped_in_blocks_total > 0
    assert stats.num_free_blocks == stats.num_blocks


def test_parallel_samples_equal_separate_seeded_requests(llm):
    prompt = "Once upon a time, in a land far away, there was a dragon who"   # 15 tokens: partial block
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, seed=11, max_tokens=16)
    cow_before = llm.llm_engine.scheduler.stats().num_cow_copies_total  # the module's llm: earlier tests' too
    [grouped] = llm.generate([prompt], params, use_tqdm=False)
    # Samples 2..4 each copy the shared partial block before writing to it.
    assert llm.llm_engine.scheduler.stats().num_cow_copies_total - cow_before == 3
    separate = llm.generate([prompt] * 4, [SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=16)
                                          for i in range(4)], use_tqdm=False)
    assert [c.token_ids for c in grouped.outputs] == [s.outputs[0].token_ids for s in separate]
    assert [c.index for c in grouped.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in grouped.outputs}) > 1


def test_best_of_returns_the_most_likely_samples(llm):
    prompt = "My favourite food is"
    [out] = llm.generate([prompt], SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=8),
                         use_tqdm=False)
    singles = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=3 + i, max_tokens=8, logprobs=0)
                                          for i in range(4)], use_tqdm=False)
    ranked = sorted((s.outputs[0] for s in singles), key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in out.outputs] == [0, 1] and out.outputs[0].cumulative_logprob is None
