"""Sizes the KV pool from a memory budget."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedserve.config import CacheConfig
from pagedserve.worker.kv_cache import kv_bytes_per_block

# On CPU, as vLLM's VLLM_CPU_KVCACHE_SPACE default, do not claim more than 4 GiB unless asked.
CPU_DEFAULT_CAP_BYTES = 4 << 30


def resident_bytes() -> int | None:
    # This process's resident set (VmRSS), Linux only.
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, slots=True)
class DraftKV:
    # A draft model's KV cache (spec_decode/draft_model.py): one block beside each of the target's, plus
    # scratch blocks for proposing past a request's allocated blocks.
    bytes_per_block: int
    num_scratch_blocks: int


def plan_num_blocks(cache: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, device: torch.device, draft: DraftKV | None = None) -> int:
    # The budget holds the target's blocks and, with a draft model, its mirrored blocks and scratch too:
    #   num_blocks = (budget - scratch bytes) // (target block bytes + draft block bytes)
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    per_block = kv_bytes_per_block(num_layers, cache.block_size, num_kv_heads, head_dim, dtype)
    fixed = 0
    if draft is not None:
        per_block += draft.bytes_per_block
        fixed = draft.bytes_per_block * draft.num_scratch_blocks
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    else:
        budget = int(available_memory_bytes(device) * cache.kv_cache_fraction)
        if device.type == "cpu":
            budget = min(budget, CPU_DEFAULT_CAP_BYTES)
    num_blocks = (budget - fixed) // per_block
    if num_blocks < 1:
        what = f"{per_block} bytes" + (f" (draft model's included) after {fixed} bytes of draft scratch blocks"
                                        if draft else "")
        raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of {what}")
    return num_blocks
