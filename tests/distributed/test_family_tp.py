"""Tensor parallelism (2 ranks) for Qwen3, Gemma 2, Gemma 3 and Phi-3: each rank holds its heads of the
windowed, capped, q/k-normed or fused layers, and greedy tokens equal transformers' (tests/model/test_families.py
builds the configs)."""
from __future__ import annotations

import gc

import pytest

from pagedserve import LLM
from tests.model.test_families import FAMILIES, assert_matches_transformers, family_model_dir, random_prompts


@pytest.mark.parametrize("name", FAMILIES)
def test_tp2_family_matches_transformers(name: str, embedded_model, tmp_path) -> None:
    hf_model, model_dir = family_model_dir(name, embedded_model, tmp_path / name, seed=2)
    llm = LLM(model_dir, tensor_parallel_size=2, block_size=16, max_num_batched_tokens=16,
              enable_prefix_caching=True, kv_cache_memory_bytes=1 << 21, max_num_seqs=4, distributed_timeout=60)
    try:
        assert llm.llm_engine.runner.kv_caches[0].shape[3] == 1  # 2 KV heads / 2 ranks
        assert_matches_transformers(llm, hf_model, random_prompts(6, (29, 20)), 10, name)
    finally:
        llm.llm_engine.core.shutdown()
    del llm
    gc.collect()
