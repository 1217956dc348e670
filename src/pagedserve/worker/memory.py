"""Sizes the KV pool from a memory budget."""
from __future__ import annotations

import os

import torch

from pagedserve.config import CacheConfig
from pagedserve.worker.kv_cache import kv_bytes_per_block

# On CPU, as vLLM's VLLM_CPU_KVCACHE_SPACE default, do not claim more than 4 GiB unless asked.
CPU_DEFAULT_CAP_BYTES = 4 << 30


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_num_blocks(cache: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, device: torch.device) -> int:
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    per_block = kv_bytes_per_block(num_layers, cache.block_size, num_kv_heads, head_dim, dtype)
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    else:
        budget = int(available_memory_bytes(device) * cache.kv_cache_fraction)
        if device.type == "cpu":
            budget = min(budget, CPU_DEFAULT_CAP_BYTES)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes")
    return num_blocks
