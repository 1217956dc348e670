"""The paged KV pool: one tensor per layer, shaped [2, num_blocks, block_size, num_kv_heads, head_dim].

Index 0 holds keys, 1 values. Flat slot s = block_id * block_size + offset addresses one token's K/V, so
`cache[0].view(-1, num_kv_heads, head_dim)[s]` is that token's key. Block ids come from the scheduler's
block pool; this module only owns the memory.
"""
from __future__ import annotations

import torch


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: str | torch.device) -> list[torch.Tensor]:
    return [torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)]
