"""The engine seed (--seed) makes unseeded sampling reproducible across restarts; a request's own seed wins."""
from __future__ import annotations

import transformers

from pagedserve import LLM, SamplingParams
from tests.tiny_models import random_hf_model, save_hf_dir

PROMPTS = ["The quick brown fox", "1, 2, 3,", "Paris is"]


def test_engine_seed_makes_unseeded_sampling_reproducible(embedded_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = embedded_model.tokenizer
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=len(tokenizer),
                                      max_position_embeddings=64, tie_word_embeddings=True)
    model_dir = save_hf_dir(random_hf_model(config, scale=0.3), tokenizer, tmp_path / "tiny-llama")

    def sample(engine_seed: int) -> tuple[list[list[int]], list[int]]:
        # A fresh engine each time: a restart of the server with the same --seed.
        llm = LLM(model=model_dir, seed=engine_seed, kv_cache_memory_bytes=1 << 20)
        unseeded = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
        outs = llm.generate(PROMPTS, unseeded, use_tqdm=False)
        [own] = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=9),
                             use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], own.outputs[0].token_ids

    first, own_first = sample(5)
    again, own_again = sample(5)
    other, own_other = sample(6)
    assert first == again
    assert first != other
    assert own_first == own_again == own_other
