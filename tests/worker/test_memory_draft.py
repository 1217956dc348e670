"""The memory plan counts a draft model's KV cache (its mirrored blocks and scratch blocks) inside the KV budget."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from pagedserve.config import CacheConfig
from pagedserve.kv_spec import KVCacheSpec
from pagedserve.worker.memory import DraftKV, kv_budget_bytes, plan_num_blocks, plan_num_host_blocks
from tests.spec_decode.test_draft_model import draft_config, tiny  # noqa: F401  (fixture)


def test_plan_counts_draft_blocks_and_scratch():
    cache = CacheConfig(block_size=4, kv_cache_memory_bytes=100_000)
    # Target block: 2 x 2 layers x 4 tokens x 1 head x 8 dims x 4 bytes = 512 bytes -> 195 blocks alone.
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, kv_dtype="float32")
    assert spec.bytes_per_block == 512 and spec.bytes_per_token == 128
    budget = kv_budget_bytes(cache, torch.device("cpu"))
    assert plan_num_blocks(cache, spec.bytes_per_block, budget) == 195
    # With a 256-byte draft block and 10 scratch blocks: (100000 - 2560) // (512 + 256) = 126.
    draft = DraftKV(bytes_per_block=256, num_scratch_blocks=10)
    assert plan_num_blocks(cache, spec.bytes_per_block, budget, draft) == 126
    with pytest.raises(ValueError, match="draft"):
        plan_num_blocks(cache, spec.bytes_per_block, 3000, draft)
    # Swap space: 1 MiB of host blocks, the draft's copy of each included; none with swap preemption is refused.
    swap = CacheConfig(block_size=4, swap_space_gib=1 / 1024)
    assert plan_num_host_blocks(swap, spec.bytes_per_block) == (1 << 20) // 512
    assert plan_num_host_blocks(swap, spec.bytes_per_block, draft) == (1 << 20) // 768
    with pytest.raises(ValueError, match="swap_space"):
        plan_num_host_blocks(CacheConfig(swap_space_gib=0, preemption_mode="swap"), spec.bytes_per_block)


def test_engine_budget_includes_the_draft_kv(tiny):  # noqa: F811
    budget = 1 << 20
    kw = dict(model=tiny["target"], kv_cache_memory_bytes=budget, max_num_seqs=8, block_size=4)
    core = LLM(**kw, speculative_config=draft_config(tiny["draft"], k=4, dtype="bfloat16")).llm_engine.core
    # Target (2 layers) float32: 2 x 2 x 4 x 1 x 16 x 4 = 1024 B a block; draft (1 layer) bfloat16:
    # 2 x 1 x 4 x 1 x 16 x 2 = 256 B; scratch: 8 seqs x (ceil(4 / 4) + 1) = 16 draft blocks.
    assert core.num_kv_blocks == (budget - 16 * 256) // (1024 + 256) == 816
    caches = core.runner.kv_caches + core.executor.proposer.kv_caches
    assert sum(c.numel() * c.element_size() for c in caches) <= budget
    assert core.executor.proposer.kv_caches[0].shape[1] == 816 + 16


def test_pagedserve_plan_counts_the_draft_like_the_engine(tiny):  # noqa: F811
    from pagedserve.plan import DraftPlan, plan, read_model

    # The same numbers as the engine test above: 816 blocks of 4 tokens.
    p = plan(read_model(tiny["target"]), (1 << 20) / (1 << 30), None, 4, "float32", [16],
             DraftPlan(read_model(tiny["draft"]), "bfloat16", 4, 8))
    assert p["budget_blocks"] == 816 and p["draft"]["scratch_blocks"] == 16
    assert plan(read_model(tiny["target"]), (1 << 20) / (1 << 30), None, 4, "float32", [16])["budget_blocks"] == 1024
    assert p["kv_bytes_per_token"] == 2 * 2 * 16 * 4 and p["draft"]["kv_bytes_per_token"] == 2 * 1 * 16 * 2
