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


def allocate_host_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    # The swap pool lives in host memory; pinned when the device is a GPU so copies run asynchronously.
    pin = device.type == "cuda"
    return [torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, pin_memory=pin)
            for _ in range(num_layers)]


def apply_block_ops(ops, kv_caches: list[torch.Tensor], host_caches: list[torch.Tensor]) -> None:
    """Run a plan's swap-outs, swap-ins and copy-on-write copies, in that order, before the forward pass."""
    if not ops:
        return
    for pairs, src_caches, dst_caches in ((ops.swap_out, kv_caches, host_caches),
                                          (ops.swap_in, host_caches, kv_caches),
                                          (ops.copy, kv_caches, kv_caches)):
        if not pairs:
            continue
        src_ids = torch.tensor([s for s, _ in pairs], device=src_caches[0].device)
        dst_ids = torch.tensor([d for _, d in pairs], device=dst_caches[0].device)
        for src, dst in zip(src_caches, dst_caches):
            dst[:, dst_ids] = src[:, src_ids].to(dst.device, non_blocking=True)
