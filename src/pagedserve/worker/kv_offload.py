"""The disk tier's side that touches tensors: open it for a model, copy blocks out for it and back in.

A block's bytes on disk are its K/V in every layer, [num_layers, 2, block_size, num_kv_heads, row] in the
cache's storage dtype (8-bit caches with their scales), exactly as the pool holds them: loading is a copy,
never a conversion, so a block read back equals the block that was computed. With a draft model
(spec_decode/draft_model.py) the draft's mirrored block follows in the same file, its layers after the
target's: a block loaded from disk comes with the draft's K/V, as a prefix hit in the pool does.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedserve.core.kv_disk import DiskKVStore, check_offload_config, make_disk_hash_root, model_fingerprint


def open_disk_tier(config, block_nbytes: int, draft_block_nbytes: int = 0) -> DiskKVStore | None:
    # None without --kv-offload-dir. config: the EngineConfig with dtype and KV dtype resolved.
    # draft_block_nbytes: the draft model's mirrored block (0 without one), stored in the same file.
    cache = config.cache
    if cache.kv_offload_dir is None:
        return None
    check_offload_config(config)
    from pagedserve.model.loader import default_model_path

    m = config.model
    path = m.model if m.model is not None else default_model_path()
    layout = dict(dtype=m.dtype, kv_dtype=cache.cache_dtype, block_size=cache.block_size,
                  quantization=m.quantization, attention_backend=m.attention_backend, block_nbytes=block_nbytes)
    spec = config.speculative
    if draft_block_nbytes:  # only then: files written without a draft keep their keys
        layout["draft"] = dict(fingerprint=model_fingerprint(spec.model), dtype=spec.dtype or m.dtype,
                               quantization=spec.quantization, block_nbytes=draft_block_nbytes)
    root = make_disk_hash_root(model_fingerprint(path, m.load_format), **layout)
    return DiskKVStore(cache.kv_offload_dir, cache.kv_offload_max_bytes, block_nbytes + draft_block_nbytes, root)


def block_nbytes(kv_caches: list[torch.Tensor]) -> int:
    # One block's K/V over these layers.
    return sum(cache[:, 0].numel() * cache.element_size() for cache in kv_caches)


class BlockViews:
    """Blocks' K/V as views of a host pool, in file order (layer by layer, K then V): no copy. The disk tier's
    writer reads them while the KV manager keeps the blocks pinned."""

    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        assert kv_caches[0].device.type == "cpu"
        self.caches = [cache.view(torch.uint8).numpy() for cache in kv_caches]  # [2, blocks, ...] each

    def __call__(self, block_ids: list[int]) -> list[list[np.ndarray]]:
        return [[cache[kv, b] for cache in self.caches for kv in (0, 1)] for b in block_ids]


def read_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> list[memoryview]:
    # One contiguous copy of the blocks, [n, layers, 2, ...] as bytes; each view keeps it alive. For a pool on
    # a device; a host pool is read through BlockViews.
    first = kv_caches[0]
    ids = torch.tensor(block_ids, device=first.device)
    out = torch.empty((len(block_ids), len(kv_caches), *first[:, 0].shape), dtype=first.dtype)
    for layer, cache in enumerate(kv_caches):  # index_select then one strided copy: the fastest of the ways tried
        out[:, layer].copy_(cache.index_select(1, ids).transpose(0, 1))
    raw = out.view(torch.uint8).reshape(len(block_ids), -1).numpy()
    return [memoryview(row) for row in raw]


def read_block_groups(groups: list[list[torch.Tensor]], block_ids: list[int]) -> list[list[memoryview]]:
    # Each block as its pieces in file order: the target's layers, then the draft's.
    return [list(parts) for parts in zip(*(read_blocks(group, block_ids) for group in groups))]


def write_blocks(kv_caches: list[torch.Tensor], loads: list[tuple[int, bytearray]], offset: int = 0) -> None:
    # Each payload's bytes from offset on are these layers' K/V (offset: past the target's, for the draft's).
    first = kv_caches[0]
    nbytes = block_nbytes(kv_caches)
    if first.device.type == "cpu":
        # numpy copies each block's rows straight from its buffer: 62 blocks of the embedded model in ~7 ms,
        # where torch's index_put over the stacked blocks took ~17 ms (1 thread).
        caches = [cache.view(torch.uint8).numpy() for cache in kv_caches]
        shape = (len(caches), *caches[0][:, 0].shape)  # [layers, 2, block_size, heads, row bytes]
        for block_id, payload in loads:
            block = np.frombuffer(payload, dtype=np.uint8, count=nbytes, offset=offset).reshape(shape)
            for cache, layer in zip(caches, block):
                cache[:, block_id] = layer
        return
    shape = (len(loads), len(kv_caches), *first[:, 0].shape)  # [n, layers, 2, block_size, heads, row]
    data = torch.stack([torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset)
                        for _, payload in loads])
    blocks = data.view(first.dtype).view(shape).to(first.device).permute(1, 2, 0, 3, 4, 5)
    ids = torch.tensor([block_id for block_id, _ in loads], device=first.device)
    for cache, layer in zip(kv_caches, blocks):
        cache[:, ids] = layer
