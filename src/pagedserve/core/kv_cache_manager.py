"""The scheduler's only view of KV memory: block tables per request, prefix-cache lookups, allocation.

A request's block table covers its computed tokens plus the tokens scheduled this step:

    tokens:  |<----- num_computed ----->|<-- num_new -->|
    blocks:  [ b0 ][ b1 ][ b2 ][ b3 (partly filled) ....]

Full blocks are registered in the prefix cache once their tokens are computed. Only full blocks are ever
shared, so no write ever lands in a block that another sequence reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from pagedserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries: int = 0   # prompt tokens looked up
    num_hits: int = 0      # of which served from the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    def _block_hashes(self, req: Request, num_full_blocks: int) -> list[BlockHash]:
        hashes = self.req_hashes.setdefault(req.req_id, [])
        bs = self.block_size
        tokens = req.all_token_ids
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        if not self.enable_caching or self.req_blocks.get(req.req_id):
            return [], 0
        # The last token is always recomputed: its logits are needed to sample the next one.
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in self._block_hashes(req, req.num_tokens // self.block_size)[:max_hit_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, req: Request, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_stats.num_queries += req.num_tokens
            self.prefix_stats.num_hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> list[int] | None:
        """Make room for num_new_tokens more tokens; None when the pool is short (the preemption signal)."""
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(req.req_id, [])
        num_tokens = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = cdiv(num_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        # Hit blocks that sit in the free queue stop being allocatable once we take them.
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return None
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        blocks.extend(new_blocks)
        self.num_cached_blocks.setdefault(req.req_id, len(computed_blocks))
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, req: Request) -> None:
        # Register blocks that became full with computed tokens.
        if not self.enable_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        start = self.num_cached_blocks.get(req.req_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(req, num_full)
        blocks = self.req_blocks[req.req_id]
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self.num_cached_blocks[req.req_id] = num_full

    def free(self, req: Request, finished: bool = True) -> None:
        blocks = self.req_blocks.pop(req.req_id, [])
        self.pool.free(list(reversed(blocks)))
        self.num_cached_blocks.pop(req.req_id, None)
        if finished:
            self.req_hashes.pop(req.req_id, None)
