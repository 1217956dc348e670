"""A picture of the paged KV cache for GET /debug/kv: every physical block, who holds it, the block tables and
the pool's counters. Pure Python, no torch.

Two halves, so the engine thread pays for a copy and not for the JSON:

    engine thread, between two steps           any thread
    capture_kv_state(scheduler) -> KVState  -> kv_snapshot_json(state) -> bytes (the /debug/kv body)

The copy is one pass over the pool (about 0.1 ms per thousand blocks); the JSON costs roughly ten times more
and is built off the engine thread. Block states:

    free     ref_count 0, no hash: nothing worth keeping
    in_use   ref_count > 0: held by the requests in `holders` (ref_count > 1: shared, e.g. n samples of one
             prompt or one system prompt under many requests)
    cached   ref_count 0 with a hash: evictable, yet a request with the same prefix can still take it back
    swapped  a host-pool block holding a preempted request's K/V (listed under "swapped", not "blocks": the
             host pool is a second, separate pool)

Invariant the tests check: a device block's ref_count equals the number of block tables that list it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

HASH_PREFIX_BYTES = 4  # 8 hex digits: enough to tell blocks apart on a page, too short to probe the cache


@dataclass(slots=True)
class KVState:
    # Plain values copied from the live pool; nothing here is shared with the engine thread afterwards.
    num_blocks: int
    block_size: int
    prefix_caching: bool
    ref_counts: list[int]
    hashes: list[bytes | None]
    block_tables: dict[str, list[int]]       # req_id -> device block ids, in logical order
    host_tables: dict[str, list[int]]        # req_id -> host block ids of a swapped-out request
    requests: dict[str, tuple[str, int, int]]  # req_id -> (status, num_tokens, num_computed_tokens)
    counters: dict[str, Any]


def capture_kv_state(scheduler: Any) -> KVState:
    """Engine thread only: the scheduler and its KV cache manager are not thread-safe."""
    kv = scheduler.kv
    pool, host = kv.pool, kv.host_pool
    blocks = pool.blocks
    counters = asdict(scheduler.stats())
    counters.update(num_evictions=pool.num_evictions,
                    num_host_blocks=host.num_blocks if host is not None else 0,
                    num_free_host_blocks=host.num_free_blocks if host is not None else 0)
    return KVState(
        pool.num_blocks, kv.block_size, kv.enable_caching,
        [b.ref_cnt for b in blocks], [b.block_hash for b in blocks],
        {rid: [b.block_id for b in table] for rid, table in kv.req_blocks.items()},
        {rid: [b.block_id for b in table] for rid, table in kv.swapped.items()},
        {rid: (r.status.value, r.num_tokens, r.num_computed_tokens) for rid, r in scheduler.requests.items()},
        counters)


def _holders(tables: dict[str, list[int]]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for req_id, block_ids in tables.items():
        for block_id in block_ids:
            out.setdefault(block_id, []).append(req_id)
    return out


def kv_snapshot_json(state: KVState, extra: dict[str, Any] | None = None) -> bytes:
    """The /debug/kv body. Written by hand per block (json.dumps of thousands of small dicts is the slow part);
    `extra` adds top-level keys (the server's engine stats, time, model)."""
    names = {rid: json.dumps(rid) for rid in {*state.block_tables, *state.host_tables, *state.requests}}
    holders = _holders(state.block_tables)
    counts = {"free": 0, "in_use": 0, "cached": 0}
    parts = []
    for block_id, (ref, block_hash) in enumerate(zip(state.ref_counts, state.hashes)):
        # Inlined (no per-block call): this loop is most of a snapshot's cost.
        if ref:
            kind = "in_use"
            held = holders.get(block_id)
            names_json = ",".join([names[r] for r in held]) if held else ""
        else:
            kind = "cached" if block_hash is not None else "free"
            names_json = ""
        counts[kind] += 1
        h = "null" if block_hash is None else f'"{block_hash[:HASH_PREFIX_BYTES].hex()}"'
        parts.append(f'{{"id":{block_id},"state":"{kind}","ref_count":{ref},"holders":[{names_json}],"hash":{h}}}')
    swapped = [f'{{"id":{block_id},"state":"swapped","ref_count":1,"holders":[{names[rid]}],"hash":null}}'
               for rid, table in state.host_tables.items() for block_id in table]

    requests = {}
    for rid in dict.fromkeys([*state.requests, *state.block_tables, *state.host_tables]):
        status, num_tokens, num_computed = state.requests.get(rid, (None, None, None))
        requests[rid] = {"status": status, "num_tokens": num_tokens, "num_computed_tokens": num_computed,
                         "block_ids": state.block_tables.get(rid, []),
                         "swapped_block_ids": state.host_tables.get(rid, [])}
    counters = dict(state.counters, num_in_use_blocks=counts["in_use"], num_cached_blocks=counts["cached"],
                    num_free_uncached_blocks=counts["free"])
    rest = {"num_blocks": state.num_blocks, "block_size": state.block_size,
            "prefix_caching": state.prefix_caching, "requests": requests, "counters": counters, **(extra or {})}
    tail = json.dumps(rest, separators=(",", ":"))
    return f'{{"blocks":[{",".join(parts)}],"swapped":[{",".join(swapped)}],{tail[1:]}'.encode()


def build_kv_snapshot(scheduler: Any) -> dict[str, Any]:
    """The snapshot as a dict, taken in one go (offline engines and tests, on the thread that owns them)."""
    return json.loads(kv_snapshot_json(capture_kv_state(scheduler)))
