"""The scheduler's only view of KV memory: block tables per request, prefix-cache lookups, allocation.

A request's block table covers its computed tokens plus the tokens scheduled this step:

    tokens:  |<----- num_computed ----->|<-- num_new -->|
    blocks:  [ b0 ][ b1 ][ b2 ][ b3 (partly filled) ....]

Full blocks are registered in the prefix cache once their tokens are computed. Forked sequences (parallel
samples) also share a partly filled block; the first sequence to write into a block whose ref_cnt > 1 gets
a private copy first (copy-on-write), so no write ever lands in a block that another sequence reads.

Swapping moves a preempted request's blocks to a host pool and back; the copies to run are queued as
(src, dst) pairs and drained into the next SchedulerOutput.

With a disk tier (core/kv_disk.py) a prefix-cache miss goes on to the disk: blocks found there are read now,
loaded into newly allocated blocks before the next forward pass (BlockOps.load) and count as computed.
Every block that becomes cached is queued for the disk (take_disk_stores) unless it came from there. With the
pool in host memory the writer reads a block straight from it: the block is pinned (not allocatable) until
written, at most max_disk_pins at once; blocks beyond that, or beyond the writer's queue, are dropped before
any copy, so a writer that falls behind costs the engine nothing. Pins yield to requests: when the pool is
short (free_blocks_for), stores the writer has not started are dropped and their blocks unpinned.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby

from pagedserve.core.block_pool import (PROCESS_HASH_ROOT, BlockHash, BlockPool, KVBlock, hash_block_tokens,
                                        salt_key)
from pagedserve.core.kv_disk import DiskKVStore, DiskRecord
from pagedserve.core.kv_events import MEDIUM_DISK, MEDIUM_GPU, KVEventCollector
from pagedserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries: int = 0   # prompt tokens looked up
    num_hits: int = 0      # of which served from the cache


@dataclass(slots=True)
class BlockOps:
    # Copies the runner performs before the step's forward pass, in this order.
    swap_out: list[tuple[int, int]]   # (device block, host block)
    swap_in: list[tuple[int, int]]    # (host block, device block)
    copy: list[tuple[int, int]]       # (src device block, dst device block), copy-on-write
    load: list[tuple[int, bytearray]] = field(default_factory=list)  # (device block, its K/V from disk)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy or self.load)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, hash_root: BlockHash | None = None,
                 kv_events: KVEventCollector | None = None, disk: DiskKVStore | None = None) -> None:
        self.block_size = block_size
        # The disk tier needs hashes that mean the same in every process: its root replaces the random one.
        self.hash_root = disk.hash_root if disk is not None else PROCESS_HASH_ROOT if hash_root is None else hash_root
        self.disk = disk
        self._disk_hits: tuple[str, list[tuple[BlockHash, bytearray]]] | None = None
        self._disk_stores: list[DiskRecord] = []
        self.max_disk_pins = max(1, num_blocks // 8)  # pinned blocks shrink the pool for the scheduler
        self.num_disk_pins = 0
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # Other tiers (disk) record into the same collector, so consumers see one ordered stream.
        self.kv_events = kv_events
        if kv_events is not None:
            self.pool.events = kv_events.tier(MEDIUM_GPU)
            if disk is not None:
                disk.events = kv_events.tier(MEDIUM_DISK)
        self.host_pool = BlockPool(num_host_blocks, False) if num_host_blocks else None
        self.swapped: dict[str, list[KVBlock]] = {}
        self._ops = BlockOps([], [], [])
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
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
            if i:
                hashes.append(hash_block_tokens(hashes[i - 1], tokens[i * bs:(i + 1) * bs]))
            else:  # requests with different cache salts (or longrope factor sets) never share a block
                extra = salt_key(req.cache_salt) + (b"longrope:long" if req.long_rope else b"")
                hashes.append(hash_block_tokens(self.hash_root, tokens[:bs], extra))
        return hashes

    def forget_hashes(self, req: Request) -> None:
        # req's blocks will be computed anew under another key (longrope's long factors).
        self.req_hashes.pop(req.req_id, None)

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        if not self.enable_caching or req.skip_prefix_cache_reads or self.req_blocks.get(req.req_id):
            return [], 0
        # The last token is always recomputed: its logits are needed to sample the next one.
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in self._block_hashes(req, req.num_tokens // self.block_size)[:max_hit_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        # Blocks read from disk for this request on an earlier try that found the pool short are not read again.
        earlier = dict(self._disk_hits[1]) if self._disk_hits and self._disk_hits[0] == req.req_id else {}
        self._disk_hits = None
        if self.disk is not None and len(hits) < max_hit_blocks:
            # No more blocks than the pool could give this request: the rest would be read for nothing.
            room = self.pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)
            loaded = []
            for block_hash in self.req_hashes[req.req_id][len(hits):min(max_hit_blocks, len(hits) + room)]:
                payload = earlier.get(block_hash) or self.disk.load(block_hash)
                if payload is None:
                    break
                loaded.append((block_hash, payload))
            if loaded:
                self._disk_hits = (req.req_id, loaded)
        return hits, (len(hits) + len(self._disk_hits[1] if self._disk_hits else ())) * self.block_size

    def num_shared_prefix_tokens(self, req: Request, other: Request) -> int:
        """Tokens of req's prompt (full blocks that req could take as hits) that other's blocks will also hold:
        the leading block hashes they share. 0 without caching."""
        if not self.enable_caching or req.skip_prefix_cache_reads:
            return 0
        num_blocks = (req.num_tokens - 1) // self.block_size  # the last token is always computed
        mine = self._block_hashes(req, num_blocks)[:num_blocks]
        theirs = self.req_hashes.get(other.req_id, ())
        n = 0
        for a, b in zip(mine, theirs):
            if a != b:
                break
            n += 1
        return n * self.block_size

    def record_prefix_query(self, req: Request, num_hit_tokens: int) -> None:
        if self.enable_caching and not req.skip_prefix_cache_reads:  # it never asked the cache
            self.prefix_stats.num_queries += req.num_tokens
            self.prefix_stats.num_hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> list[int] | None:
        """Make room for num_new_tokens more tokens; None when the pool is short (the preemption signal)."""
        computed_blocks = computed_blocks or []
        # Blocks get_computed_blocks just read from disk for this request follow computed_blocks; they take
        # new blocks, counted in num_needed.
        blocks = self.req_blocks.setdefault(req.req_id, [])
        pending = self._disk_hits
        disk_hits = pending[1] if pending and pending[0] == req.req_id and not blocks else []
        num_computed_blocks = len(computed_blocks) + len(disk_hits)
        num_tokens = req.num_computed_tokens + num_computed_blocks * self.block_size + num_new_tokens
        num_needed = max(cdiv(num_tokens, self.block_size) - len(blocks) - len(computed_blocks), 0)
        # The first write lands in block write_idx; if another sequence shares it, it is copied first.
        write_idx = req.num_computed_tokens // self.block_size
        cow = not computed_blocks and write_idx < len(blocks) and blocks[write_idx].ref_cnt > 1
        # Hit blocks that sit in the free queue stop being allocatable once we take them.
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed + cow > self.free_blocks_for(num_needed + cow + num_free_hits) - num_free_hits:
            return None
        if cow:
            [copy] = self.pool.allocate(1)
            self._ops.copy.append((blocks[write_idx].block_id, copy.block_id))
            self.pool.free([blocks[write_idx]])
            blocks[write_idx] = copy
            self.num_cow_copies += 1
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new_blocks = self.pool.allocate(num_needed)
        blocks.extend(new_blocks)
        if disk_hits:
            self._disk_hits = None  # taken; a refusal above keeps them for the request's next try
            # Loaded before any forward pass reads them, so cached at once. A hash the pool still holds in another
            # block (its parent was evicted, not it) is not added again, nor reported.
            self._ops.load.extend((block.block_id, payload) for block, (_, payload) in zip(new_blocks, disk_hits))
            added = [self.pool.cache(block, h) for block, (h, _) in zip(new_blocks, disk_hits)]
            if self.pool.events is not None:
                self._report_stored(req, self.req_hashes[req.req_id], len(computed_blocks), added)
            stats = self.disk.stats
            stats.num_loaded_blocks += len(disk_hits)
            stats.loaded_bytes += len(disk_hits) * self.disk.block_nbytes
            stats.num_hit_tokens += len(disk_hits) * self.block_size
        self.num_cached_blocks.setdefault(req.req_id, num_computed_blocks)
        return [b.block_id for b in new_blocks]

    def fork(self, src: Request, dst: Request, num_tokens: int) -> None:
        """dst shares src's blocks holding its first num_tokens tokens (dst's own tokens are the same)."""
        shared = self.req_blocks[src.req_id][:cdiv(num_tokens, self.block_size)]
        self.pool.touch(shared)
        self.req_blocks[dst.req_id] = list(shared)
        self.num_cached_blocks[dst.req_id] = min(self.num_cached_blocks.get(src.req_id, 0),
                                                 num_tokens // self.block_size)

    def can_swap_out(self, req: Request) -> bool:
        return (self.host_pool is not None
                and len(self.req_blocks.get(req.req_id, ())) <= self.host_pool.num_free_blocks)

    def swap_out(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.req_id)
        host = self.host_pool.allocate(len(blocks))
        self._ops.swap_out.extend((d.block_id, h.block_id) for d, h in zip(blocks, host))
        self.pool.free(list(reversed(blocks)))
        self.num_cached_blocks.pop(req.req_id, None)
        self.swapped[req.req_id] = host
        self.num_swapped_out_blocks += len(host)

    def is_swapped(self, req: Request) -> bool:
        return req.req_id in self.swapped

    def swap_in(self, req: Request, num_new_tokens: int) -> list[int] | None:
        host = self.swapped[req.req_id]
        num_needed = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size)
        if num_needed > self.free_blocks_for(num_needed):
            return None
        blocks = self.pool.allocate(num_needed)
        self._ops.swap_in.extend((h.block_id, d.block_id) for h, d in zip(host, blocks))
        self.host_pool.free(host)
        del self.swapped[req.req_id]
        self.req_blocks[req.req_id] = blocks
        self.num_cached_blocks[req.req_id] = 0
        self.num_swapped_in_blocks += len(host)
        return [b.block_id for b in blocks]

    def take_block_ops(self) -> BlockOps:
        ops, self._ops = self._ops, BlockOps([], [], [])
        return ops

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
        added = [self.pool.cache(blocks[i], hashes[i]) for i in range(start, num_full)]
        if self.pool.events is not None:
            self._report_stored(req, hashes, start, added)
        if self.disk is not None:
            self._disk_stores.extend(self._disk_record(req, hashes, i, blocks[i].block_id)
                                     for i in range(start, num_full) if added[i - start])
        self.num_cached_blocks[req.req_id] = num_full

    def _disk_record(self, req: Request, hashes: list[BlockHash], i: int, block_id: int) -> DiskRecord:
        bs = self.block_size
        return DiskRecord(block_id, hashes[i], hashes[i - 1] if i else None,
                          tuple(req.all_token_ids[i * bs:(i + 1) * bs]), _extra_keys(req, i))

    def take_disk_stores(self) -> list[DiskRecord]:
        # Blocks cached since the last call: the worker copies them out for the disk before the next plan
        # can reuse them.
        stores, self._disk_stores = self._disk_stores, []
        return stores

    def write_disk_stores(self, read_blocks, pin: bool) -> None:
        # After a step. read_blocks(block ids) -> each block's K/V as a list of buffers in file order: views of
        # the pool (pin: the blocks stay pinned until written) or copies.
        self.release_disk_pins()
        stores = self.take_disk_stores()
        if not stores:
            return
        fit = min(len(stores), self.disk.room(), self.max_disk_pins - self.num_disk_pins if pin else len(stores))
        self.disk.stats.num_dropped_stores += len(stores) - fit
        stores = stores[:fit]
        for record, payload in zip(stores, read_blocks([r.block_id for r in stores])):
            if pin:
                self.pool.pin(self.pool.blocks[record.block_id])
                self.num_disk_pins += 1
            self.disk.store(record, payload, pinned=pin)

    def release_disk_pins(self, cancel: bool = False) -> None:
        # Blocks the writer is done with become allocatable again; with cancel, those it has not started too.
        for block_id in self.disk.take_written() + (self.disk.cancel_pinned() if cancel else []):
            self.pool.unpin(self.pool.blocks[block_id])
            self.num_disk_pins -= 1

    def free_blocks_for(self, num_needed: int) -> int:
        # The pool's free blocks; when fewer than num_needed, pinned blocks not yet being written are freed first.
        if num_needed > self.pool.num_free_blocks and self.num_disk_pins:
            self.release_disk_pins(cancel=True)
        return self.pool.num_free_blocks

    def _report_stored(self, req: Request, hashes: list[BlockHash], start: int, added: list[bool]) -> None:
        # One BlockStored per run of blocks this call added; a block whose hash another block already holds
        # (two requests computed the same prefix at once) was not added, and its run ends there.
        bs = self.block_size
        for was_added, run in groupby(range(start, start + len(added)), key=lambda k: added[k - start]):
            if not was_added:
                continue
            run = list(run)
            i, j = run[0], run[-1] + 1
            self.pool.events.stored(hashes[i:j], hashes[i - 1] if i else None, req.all_token_ids[i * bs:j * bs],
                                    [_extra_keys(req, k) for k in run])

    def free(self, req: Request, finished: bool = True) -> None:
        blocks = self.req_blocks.pop(req.req_id, [])
        self.pool.free(list(reversed(blocks)))
        host = self.swapped.pop(req.req_id, None)
        if host:
            self.host_pool.free(host)
        self.num_cached_blocks.pop(req.req_id, None)
        if finished:
            self.req_hashes.pop(req.req_id, None)


def _extra_keys(req: Request, i: int) -> tuple[str, ...] | None:
    # What a KV event (pool or disk) reports beside block i's tokens: the request's cache_salt, in its first
    # block's key only (block_pool.salt_key).
    return (req.cache_salt,) if i == 0 and req.cache_salt is not None else None
