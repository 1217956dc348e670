"""A JSON-ready picture of the paged KV cache (GET /debug/kv): every physical block, who holds it, the block
tables and the pool's counters. Pure Python, no torch.

Built on the engine thread, the only one that may read the pool, and handed over as plain dicts and lists.
Block states:

    free     ref_count 0, no hash: nothing worth keeping
    in_use   ref_count > 0: held by the requests in `holders` (ref_count > 1: shared, e.g. n samples of one
             prompt or one system prompt under many requests)
    cached   ref_count 0 with a hash: evictable, yet a request with the same prefix can still take it back
    swapped  a host-pool block holding a preempted request's K/V (listed under "swapped", not "blocks")

Invariant the tests check: a device block's ref_count equals the number of block tables that list it.
"""
from __future__ import annotations

from typing import Any

from pagedserve.core.block_pool import KVBlock
from pagedserve.core.kv_cache_manager import KVCacheManager

HASH_PREFIX_BYTES = 4  # 8 hex digits: enough to tell blocks apart on a page, too short to probe the cache


def block_state(block: KVBlock) -> str:
    if block.ref_cnt > 0:
        return "in_use"
    return "cached" if block.block_hash is not None else "free"


def _holders(tables: dict[str, list[KVBlock]]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for req_id, blocks in tables.items():
        for block in blocks:
            out.setdefault(block.block_id, []).append(req_id)
    return out


def _block_entry(block: KVBlock, holders: list[str], state: str | None = None) -> dict[str, Any]:
    h = block.block_hash
    return {"id": block.block_id, "state": state or block_state(block), "ref_count": block.ref_cnt,
            "holders": holders, "hash": h[:HASH_PREFIX_BYTES].hex() if h is not None else None}


def build_kv_snapshot(kv: KVCacheManager, scheduler: Any = None) -> dict[str, Any]:
    """The cache as it is now. `scheduler` (a core Scheduler) adds request states and queue counts."""
    pool = kv.pool
    holders = _holders(kv.req_blocks)
    blocks = [_block_entry(b, holders.get(b.block_id, [])) for b in pool.blocks]
    host_holders = _holders(kv.swapped)
    swapped = [_block_entry(b, host_holders[b.block_id], "swapped")
               for table in kv.swapped.values() for b in table]
    counts = {"free": 0, "in_use": 0, "cached": 0}
    for entry in blocks:
        counts[entry["state"]] += 1

    requests: dict[str, dict[str, Any]] = {}
    sched_requests = getattr(scheduler, "requests", {}) if scheduler is not None else {}
    for req_id in dict.fromkeys([*sched_requests, *kv.req_blocks, *kv.swapped]):
        req = sched_requests.get(req_id)
        requests[req_id] = {
            "status": req.status.value if req is not None else None,
            "num_tokens": req.num_tokens if req is not None else None,
            "num_computed_tokens": req.num_computed_tokens if req is not None else None,
            "block_ids": kv.block_ids(req_id),
            "swapped_block_ids": [b.block_id for b in kv.swapped.get(req_id, ())],
        }

    counters = {
        "num_free_blocks": pool.num_free_blocks,      # free + cached: both can be allocated
        "num_in_use_blocks": counts["in_use"],
        "num_cached_blocks": counts["cached"],
        "num_shared_blocks": pool.num_shared_blocks,
        "usage": pool.usage(),
        "prefix_cache_queries": kv.prefix_stats.num_queries,
        "prefix_cache_hits": kv.prefix_stats.num_hits,
        "num_evictions": pool.num_evictions,
        "num_cow_copies": kv.num_cow_copies,
        "num_swapped_out_blocks": kv.num_swapped_out_blocks,
        "num_swapped_in_blocks": kv.num_swapped_in_blocks,
        "num_host_blocks": kv.host_pool.num_blocks if kv.host_pool is not None else 0,
        "num_free_host_blocks": kv.host_pool.num_free_blocks if kv.host_pool is not None else 0,
    }
    if scheduler is not None:
        stats = scheduler.stats()
        counters.update(num_running=stats.num_running, num_waiting=stats.num_waiting,
                        num_preemptions=stats.num_preemptions_total,
                        num_preemptions_swap=stats.num_preemptions_swap_total)
    return {"num_blocks": pool.num_blocks, "block_size": kv.block_size, "prefix_caching": kv.enable_caching,
            "blocks": blocks, "swapped": swapped, "requests": requests, "counters": counters}
