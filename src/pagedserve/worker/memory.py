"""Sizes the KV pools: device blocks from a memory budget, host (swap) blocks from --swap-space."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedserve.config import CacheConfig

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


def kv_budget_bytes(cache: CacheConfig, device: torch.device) -> int:
    # What the KV pools may take: --kv-cache-memory-bytes, else a fraction of what the device has free.
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    budget = int(available_memory_bytes(device) * cache.kv_cache_fraction)
    return min(budget, CPU_DEFAULT_CAP_BYTES) if device.type == "cpu" else budget


def plan_num_blocks(cache: CacheConfig, bytes_per_block: int, budget_bytes: int, draft: DraftKV | None = None) -> int:
    # The budget holds the target's blocks and, with a draft model, its mirrored blocks and scratch too:
    #   num_blocks = (budget - scratch bytes) // (target block bytes + draft block bytes)
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    per_block, fixed = bytes_per_block, 0
    if draft is not None:
        per_block += draft.bytes_per_block
        fixed = draft.bytes_per_block * draft.num_scratch_blocks
    num_blocks = (budget_bytes - fixed) // per_block
    if num_blocks < 1:
        what = f"{per_block} bytes" + (f" (draft model's included) after {fixed} bytes of draft scratch blocks"
                                        if draft else "")
        raise ValueError(f"the KV cache budget ({budget_bytes} bytes) holds no block of {what}")
    return num_blocks


def plan_num_host_blocks(cache: CacheConfig, bytes_per_block: int, draft: DraftKV | None = None) -> int:
    # The swap space holds the draft's copy of each swapped block as well.
    num_host_blocks = int(cache.swap_space_gib * (1 << 30)) // (
        bytes_per_block + (draft.bytes_per_block if draft else 0))
    if cache.preemption_mode == "swap" and num_host_blocks == 0:
        raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of host memory)")
    return num_host_blocks
