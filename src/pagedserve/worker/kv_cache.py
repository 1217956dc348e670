"""The paged KV pool: one tensor per layer, shaped [2, num_blocks, block_size, num_kv_heads, head_dim].

Index 0 holds keys, 1 values. Flat slot s = block_id * block_size + offset addresses one token's K/V, so
`cache[0].view(-1, num_kv_heads, head_dim)[s]` is that token's key. Block ids come from the scheduler's
block pool; this module only owns the memory. An 8-bit cache (--kv-cache-dtype int8 / fp8_e4m3) is
allocated with its storage dtype and rows of head_dim + 4 elements, the last 4 a float32 scale
(attention/kv_quant.py); block copies move scales with their rows.

A model's KV geometry on one device or tensor-parallel rank is a KVCacheSpec (kv_spec.py, torch-free); the
target, the draft model and every rank allocate through allocate() / allocate_host() with it.
"""
from __future__ import annotations

import math
import mmap

import torch

from pagedserve.attention.kv_quant import row_width, storage_dtype
from pagedserve.kv_spec import KVCacheSpec
from pagedserve.worker.kv_offload import write_blocks


def allocate(spec: KVCacheSpec, num_blocks: int, device: torch.device, prefault: bool = True) -> list[torch.Tensor]:
    return allocate_kv_caches(spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim,
                              storage_dtype(spec.kv_dtype), device, prefault)


def allocate_host(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    # The swap pool for a cache on `device`: empty when there is no swap space.
    if not num_blocks:
        return []
    return allocate_host_caches(spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim,
                                storage_dtype(spec.kv_dtype), device)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: str | torch.device,
                       prefault: bool = True) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, num_kv_heads, row_width(dtype, head_dim))
    return [_zeros(shape, dtype, torch.device(device), prefault) for _ in range(num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, prefault: bool) -> torch.Tensor:
    # On CPU the pool is fresh anonymous memory, zero by definition. A page of it becomes resident when first
    # touched: with prefault (--prefault-kv-cache, the default) the kernel maps every page at start
    # (MAP_POPULATE), so the start-up RSS already holds the whole pool and a memory limit sized from it is not
    # crossed later, when requests first reach the pool's last pages. Without, untouched pages cost nothing
    # until then. Under full load the whole pool is resident either way.
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
    buf = mmap.mmap(-1, max(1, numel * torch.empty((), dtype=dtype).element_size()), flags=flags)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def allocate_host_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    # The swap pool lives in host memory; pinned when the device is a GPU so copies run asynchronously.
    pin = device.type == "cuda"
    return [torch.zeros(2, num_blocks, block_size, num_kv_heads, row_width(dtype, head_dim), dtype=dtype,
                        pin_memory=pin) for _ in range(num_layers)]


def apply_block_ops(ops, kv_caches: list[torch.Tensor], host_caches: list[torch.Tensor], load_offset: int = 0) -> None:
    """Run a plan's swap-outs, swap-ins, copy-on-write copies and disk loads, in that order, before the
    forward pass. load_offset: where these caches' K/V starts in a loaded block (past the target's for the
    draft model's)."""
    if not ops:
        return
    for pairs, src_caches, dst_caches in ((ops.swap_out, kv_caches, host_caches),
                                          (ops.swap_in, host_caches, kv_caches),
                                          (ops.copy, kv_caches, kv_caches)):
        if pairs:
            copy_blocks(pairs, src_caches, dst_caches)
    if ops.load:
        write_blocks(kv_caches, ops.load, load_offset)


def copy_blocks(pairs: list[tuple[int, int]], src_caches: list[torch.Tensor],
                dst_caches: list[torch.Tensor]) -> None:
    src_dev, dst_dev = src_caches[0].device, dst_caches[0].device
    src_ids = torch.tensor([s for s, _ in pairs], device=src_dev)
    dst_ids = torch.tensor([d for _, d in pairs], device=dst_dev)
    if src_dev.type != "cpu" and dst_dev.type == "cpu":
        # Device -> host (swap-out). A non_blocking copy returns before the data has arrived, and the
        # scatter into the host pool below runs on the host at once: it would read a buffer the DMA has
        # not filled yet. So all layers' copies are queued first and the stream is synchronized once
        # before the host reads any of them. Other device types copy blocking.
        cuda = src_dev.type == "cuda"
        staged = [src[:, src_ids].to(dst_dev, non_blocking=cuda) for src in src_caches]
        if cuda:
            torch.cuda.current_stream(src_dev).synchronize()
        for dst, blocks in zip(dst_caches, staged):
            dst[:, dst_ids] = blocks
        return
    # Host -> device (swap-in) and device -> device (copy-on-write): the copies are queued on the device
    # stream before the forward pass that reads them. The host-side gather src[:, src_ids] is a fresh
    # tensor, so a later swap-out into the same host blocks cannot change what is in flight.
    for src, dst in zip(src_caches, dst_caches):
        dst[:, dst_ids] = src[:, src_ids].to(dst_dev, non_blocking=True)
