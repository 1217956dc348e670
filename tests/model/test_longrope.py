"""Phi-3's longrope past its original length: short factors for a sequence of at most
original_max_position_embeddings (64 here) tokens, long factors at every position of a longer one, in one
batch, as transformers does (it recomputes the cache when a sequence crosses; the scheduler does too).
"""
from __future__ import annotations

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.attention.backend import get_attention_backend
from pagedserve.model.registry import get_model_class
from tests.model.test_families import _hf_greedy, assert_same_greedy, family_config
from tests.paged_metadata import build_attention_metadata, scattered_block_tables
from tests.tiny_models import random_hf_model, save_hf_dir


def test_long_and_short_sequences_in_one_batch_match_transformers(numerics) -> None:
    # A prefill of 80 tokens (long factors) and one of 40 (short) in one flattened step of the model.
    from pagedserve.worker.kv_cache import allocate_kv_caches

    config = family_config("phi3")
    hf_model = random_hf_model(config)
    ours = get_model_class("Phi3ForCausalLM")(config, get_attention_backend("auto"), dtype=torch.float32).eval()
    ours.load_weights(hf_model.state_dict().items())
    assert ours.longrope_switch == 64
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (80, 40)]
    lens = [len(s) for s in seqs]
    caches = allocate_kv_caches(2, 16, 16, ours.num_kv_heads, ours.head_dim, torch.float32, "cpu")
    meta = build_attention_metadata([(0, n) for n in lens], scattered_block_tables(lens, 16, 16), 16)
    ids = torch.tensor(seqs[0] + seqs[1])
    positions = torch.tensor(list(range(80)) + list(range(40)))
    long_rope = torch.tensor([True] * 80 + [False] * 40)
    with torch.inference_mode():
        got = ours.compute_logits(ours(ids, positions, caches, meta, long_rope=long_rope))
        want = [hf_model(torch.tensor([s])).logits[0] for s in seqs]
    diff = max((got[:80] - want[0]).abs().max().item(), (got[80:] - want[1]).abs().max().item())
    numerics["longrope_mixed_batch_logits"] = diff
    assert diff < 1e-4, f"max abs logit diff {diff}"
    # Long factors at the short sequence's positions would be another model: the test can tell them apart.
    with torch.inference_mode():
        wrong = ours.compute_logits(ours(ids, positions, caches, meta, long_rope=torch.ones(120, dtype=torch.bool)))
    assert (wrong[80:] - want[1]).abs().max().item() > 1e-2


def test_generation_past_the_original_length_matches_transformers(embedded_model, model_cache) -> None:
    # The engine: a 70-token prompt (long from the start), a 50-token prompt whose output crosses 64 tokens
    # (its K/V computed again with the long factors, as transformers' generate does), and a 44-token prompt
    # sharing the long one's first 32 tokens (its prefix-cache blocks hold the long factors' keys: no hit).
    config = family_config("phi3", vocab_size=512, eos_token_id=embedded_model.eos_token_ids[0])
    hf_model = random_hf_model(config, scale=0.3)
    model_dir = save_hf_dir(hf_model, embedded_model.tokenizer, model_cache / "phi3")
    gen = torch.Generator().manual_seed(6)
    long_prompt = torch.randint(0, 512, (70,), generator=gen).tolist()
    prompts = [long_prompt, torch.randint(0, 512, (50,), generator=gen).tolist(),
               long_prompt[:32] + torch.randint(0, 512, (12,), generator=gen).tolist()]
    llm = LLM(model=model_dir, block_size=16, max_num_batched_tokens=32, enable_prefix_caching=True,
              kv_cache_memory_bytes=1 << 21)
    assert llm.llm_engine.core.max_model_len == 256  # max_position_embeddings, not the original 64
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    for i, (ids, out) in enumerate(zip(prompts, outs)):
        want, margins = _hf_greedy(hf_model, ids, 18)
        assert_same_greedy(list(out.outputs[0].token_ids), want, margins, f"prompt {i}")
    assert llm.llm_engine.core.scheduler.num_preemptions_total >= 1  # the crossing one was recomputed
    assert outs[2].num_cached_tokens == 0
    # The same short prompt again hits the blocks the third one cached: the key tells factor sets apart only.
    again = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == outs[2].outputs[0].token_ids
