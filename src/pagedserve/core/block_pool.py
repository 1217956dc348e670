"""The pool of physical KV blocks: reference counts, an LRU free queue and the prefix-cache hash map.

Invariants:
  * a block with ref_cnt 0 is in the free queue unless pinned; a block with ref_cnt > 0 is not;
  * a block with a hash is in `cached` under that hash (one block per hash) until it is evicted;
  * the free queue is ordered least-recently-freed first, so eviction takes the coldest cached block.
Freed blocks keep their hash and contents: a later request with the same prefix can take them back
(a "cache hit on a free block") until allocation reuses them for something else.
"""
from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.core.kv_events import TierEvents
from pagedserve.core.kv_residency import BlockTrack, ResidencySampler

BlockHash = bytes


def make_hash_root(seed: str | None) -> BlockHash:
    # The parent of every first block. A fixed root would let anyone who knows the scheme predict block hashes
    # (and so probe the cache); like vLLM's NONE_HASH it is random per process unless PYTHONHASHSEED pins it.
    if seed is None or seed == "random":
        return os.urandom(32)
    return hashlib.sha256(b"pagedserve-hash-root:" + seed.encode("utf-8", "surrogatepass")).digest()


PROCESS_HASH_ROOT: BlockHash = make_hash_root(os.environ.get("PYTHONHASHSEED"))


def salt_key(cache_salt: str | None) -> bytes:
    # Mixed into a request's first block only; the chain carries it to every later block. The tag keeps a
    # salted block apart from an unsalted one even for an empty salt.
    if cache_salt is None:
        return b""
    return b"salt:" + cache_salt.encode("utf-8", "surrogatepass")


def hash_block_tokens(parent_hash: BlockHash, token_ids: list[int] | tuple[int, ...],
                      extra_key: bytes = b"") -> BlockHash:
    # A block's identity is its whole prefix: chaining the parent's hash makes equal tokens at different
    # prefixes hash differently. sha256 makes collisions (which would silently corrupt outputs) negligible.
    # Token bytes have a fixed length per block size, so extra_key cannot run into them.
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_key)
    return h.digest()


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    pinned: bool = False  # the disk tier's writer reads it: not allocatable, though maybe unreferenced
    residency: BlockTrack | None = None  # timestamps, on sampled blocks only (kv_residency.py)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.num_shared_blocks = 0  # blocks with ref_cnt > 1, kept incrementally for metrics
        self.num_pinned_free = 0    # pinned blocks with ref_cnt 0: free as far as usage() is concerned
        # Residency is about what the prefix cache keeps; the host swap pool (no caching) is not sampled.
        self.residency = ResidencySampler() if enable_caching else None
        # Set when KV events are on: every hash this pool gains (through KVCacheManager.cache_blocks, which
        # knows the tokens) or loses is reported, in order.
        self.events: TierEvents | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - (len(self.free_queue) + self.num_pinned_free) / self.num_blocks

    def allocate(self, num: int) -> list[KVBlock]:
        if num > len(self.free_queue):
            raise ValueError(f"cannot allocate {num} blocks, {len(self.free_queue)} free")
        out = []
        residency = self.residency
        for _ in range(num):
            _, block = self.free_queue.popitem(last=False)
            if residency is not None:
                residency.on_allocate(block, evicted=block.block_hash is not None)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            if self.events is not None:
                self.events.removed([block.block_hash])
            block.block_hash = None
            self.num_evictions += 1

    def touch(self, blocks: list[KVBlock]) -> None:
        # Take a reference on blocks found in the prefix cache (possibly sitting in the free queue).
        for block in blocks:
            if block.ref_cnt == 0:
                self._take(block)
            block.ref_cnt += 1
            if block.ref_cnt == 2:
                self.num_shared_blocks += 1
            if block.residency is not None:
                self.residency.on_access(block)

    def free(self, blocks: list[KVBlock]) -> None:
        # Callers pass a sequence's blocks tail first, so its last blocks (least likely to be shared) are
        # evicted before its prefix.
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 1:
                self.num_shared_blocks -= 1
            if block.ref_cnt == 0:
                self._put(block)

    def pin(self, block: KVBlock) -> None:
        # Until unpin, allocation cannot reuse the block (the disk writer reads its K/V straight from the
        # pool); prefix hits can still take it. Not a reference: usage() and sharing counts ignore it.
        assert not block.pinned, f"block {block.block_id} pinned twice"
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
            self.num_pinned_free += 1
        block.pinned = True

    def unpin(self, block: KVBlock) -> None:
        block.pinned = False
        if block.ref_cnt == 0:
            self.num_pinned_free -= 1
            self.free_queue[block.block_id] = block

    def _take(self, block: KVBlock) -> None:  # an unreferenced block gains a reference
        if block.pinned:
            self.num_pinned_free -= 1
        else:
            del self.free_queue[block.block_id]

    def _put(self, block: KVBlock) -> None:  # a block's last reference is gone
        if block.pinned:
            self.num_pinned_free += 1
        else:
            self.free_queue[block.block_id] = block

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> bool:
        # A full block becomes findable by its hash. If an equal block is already cached, keep that one.
        # True when this call added the hash (the caller reports it as stored).
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True
