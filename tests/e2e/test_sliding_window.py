"""A sliding-window model through the whole engine: greedy tokens equal transformers' generate."""
from __future__ import annotations

import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests.tiny_models import random_hf_model, save_hf_dir


def test_qwen2_sliding_window_generate_matches_transformers(embedded_model, tmp_path, monkeypatch) -> None:
    # Layer 0 full attention (the compiled kernel when it builds), layer 1 a 6-token window (the reference
    # backend's window mask); prompts and outputs run far past the window, and max_model_len is not capped.
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = embedded_model.tokenizer
    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), max_position_embeddings=128, sliding_window=6, use_sliding_window=True,
        max_window_layers=1, tie_word_embeddings=False, eos_token_id=embedded_model.eos_token_ids[0])
    hf = random_hf_model(config, scale=0.3)
    model_dir = save_hf_dir(hf, tokenizer, tmp_path / "tiny-qwen2-sliding")

    prompts = ["The quick brown fox jumps over the lazy dog.", "1, 2, 3,", "Paris is the capital of"]
    llm = LLM(model=model_dir, block_size=4, max_num_batched_tokens=8, kv_cache_memory_bytes=1 << 20)
    assert llm.llm_engine.max_model_len == 128
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            want = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == want.tolist(), prompt
