"""Draft-model speculation end to end on tiny random models: greedy output token-identical with it on and off
(an unrelated draft, and a self-draft that is accepted), sampled requests draft from q, and a draft with
another vocabulary refused. The embedded model's self-draft: tests/e2e/test_spec_decode_draft.py."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests.tiny_models import random_hf_model, save_hf_dir


def tiny_dir(tokenizer, path, seed: int, vocab_size: int = 1100, layers: int = 1) -> str:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab_size,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    return save_hf_dir(random_hf_model(config, scale=0.3, seed=seed), tokenizer, path)


def draft_config(path: str, k: int = 3, dtype: str | None = None) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, "disable_by_batch_size": None,
            "dtype": dtype}


@pytest.fixture(scope="module")
def tiny(embedded_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    tok = embedded_model.tokenizer
    return {"target": tiny_dir(tok, root / "target", seed=0, layers=2), "draft": tiny_dir(tok, root / "draft", 1),
            "other_vocab": tiny_dir(tok, root / "other", 2, vocab_size=1200)}


def test_unrelated_tiny_draft_keeps_greedy_output_exact(tiny):
    rng = random.Random(0)
    # Prompts of several lengths, some longer than a block, chunked prefill included (small token budget).
    prompts = [{"prompt_token_ids": [rng.randrange(1100) for _ in range(rng.randint(3, 40))]} for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(model=tiny["target"], kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=64, max_num_seqs=8,
              block_size=4)
    off = LLM(**kw).generate(prompts, params, use_tqdm=False)
    # The unrelated draft runs in bfloat16 (a cheaper dtype than the target's float32).
    llm = LLM(**kw, speculative_config=draft_config(tiny["draft"], k=4, dtype="bfloat16"))
    on = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    core = llm.llm_engine.core
    assert core.stats.spec.num_draft_tokens > 0
    assert core.kv.pool.num_free_blocks == core.num_kv_blocks
    # A self-draft of the tiny target accepts nearly everything; sampled requests draft from q and run too.
    self_llm = LLM(**kw, speculative_config=draft_config(tiny["target"], k=4))
    again = self_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in off]
    assert self_llm.llm_engine.core.stats.spec.acceptance_rate > 0.9
    sampled = self_llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=3),
                                use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in sampled)
    assert self_llm.llm_engine.core.kv.pool.num_free_blocks == self_llm.llm_engine.core.num_kv_blocks


def test_draft_with_another_vocabulary_is_refused(tiny):
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model=tiny["target"], kv_cache_memory_bytes=1 << 20, speculative_config=draft_config(tiny["other_vocab"]))


def test_draft_samples_with_the_requests_top_k_and_top_p(tiny):
    # q is the request's own distribution (temperature, top-k, top-p), so a self-draft is accepted nearly
    # always even when top-k / top-p cut the target's distribution; a full-softmax q would mostly be rejected.
    llm = LLM(model=tiny["target"], kv_cache_memory_bytes=1 << 20, max_num_seqs=4, block_size=4,
              speculative_config=draft_config(tiny["target"], k=3))
    drafter = llm.llm_engine.core.executor.proposer
    seen = []
    real_step = drafter.step

    def recording_step(rows):  # the real step, its q rows kept for the checks below
        ids, q = real_step(rows)
        seen.extend((ids[r], q[r]) for r in ids)
        return ids, q

    drafter.step = recording_step
    prompts = [{"prompt_token_ids": [5 + i, 17, 300 + i, 42]} for i in range(4)]
    for params, max_support in ((SamplingParams(temperature=1.0, top_k=3, max_tokens=12, seed=1), 3),
                                (SamplingParams(temperature=0.7, top_p=0.2, max_tokens=12, seed=2), None)):
        seen.clear()
        before = llm.llm_engine.core.stats.spec
        drafts, accepted = before.num_draft_tokens, before.num_accepted_tokens
        llm.generate(prompts, params, use_tqdm=False)
        assert seen
        for ids, q in seen:
            support = (q > 0).sum(dim=-1)
            assert bool((q.gather(1, torch.tensor(ids).unsqueeze(1)) > 0).all())  # drawn from q
            if max_support is not None:
                assert int(support.max()) <= max_support
            else:
                assert int(support.max()) < q.shape[1] // 10  # top-p cut the tail
        spec = llm.llm_engine.core.stats.spec
        assert (spec.num_accepted_tokens - accepted) / (spec.num_draft_tokens - drafts) > 0.9


def test_draft_runs_nothing_above_the_cut_off_and_catches_up_after(tiny):
    # Above disable_by_batch_size the draft runs no forward and lags; once the batch shrinks it catches up in
    # one pass and drafts as well as ever (a self-draft over stale K/V would be rejected), output exact.
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(1100) for _ in range(rng.randint(5, 30))]} for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 3, 5, 5, 30, 30)]
    kw = dict(model=tiny["target"], kv_cache_memory_bytes=1 << 20, max_num_seqs=8, block_size=4)
    off = LLM(**kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(**kw, speculative_config={**draft_config(tiny["target"], k=3), "disable_by_batch_size": 2})
    drafter = llm.llm_engine.core.executor.proposer
    real_propose, real_forward, drafting, flags = drafter.propose, drafter.model.forward, [], []

    def propose(step):  # the worker calls its proposer after every step, drafting or not
        drafting.append(step.drafting)
        return real_propose(step)

    def forward(*args, **kwargs):
        flags.append(drafting[-1])
        return real_forward(*args, **kwargs)

    drafter.propose, drafter.model.forward = propose, forward
    on = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert flags and all(flags)  # no draft forward in a step above the cut-off
    assert not all(drafting)  # there were such steps
    spec = llm.llm_engine.core.stats.spec
    assert spec.num_draft_tokens >= 2 * 3 * 3 and spec.acceptance_rate > 0.9
    assert llm.llm_engine.core.kv.pool.num_free_blocks == llm.llm_engine.core.num_kv_blocks
