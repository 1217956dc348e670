"""KV events from the block pool: exact events for stores, evictions, duplicates, salts and resets, and a
scheduler run under memory pressure whose event stream, replayed, always equals the pool's cached hashes."""
from __future__ import annotations

import random

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_pool import hash_block_tokens, salt_key
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventCollector,
                                       external_hash)
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams
from tests.core.helpers import WorkerMirror, make_request
from tests.core.test_cache_salt import prefill, salted

ROOT = b"root"


def make_kv(num_blocks: int = 8, block_size: int = 4) -> tuple[KVCacheManager, KVEventCollector]:
    events = KVEventCollector(block_size)
    return KVCacheManager(num_blocks, block_size, hash_root=ROOT, kv_events=events), events


def chain(tokens: list[int], block_size: int = 4, salt: str | None = None) -> list[bytes]:
    # The pool's hashes, computed independently of it.
    hashes: list[bytes] = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        hashes.append(hash_block_tokens(hashes[-1], block) if hashes else
                      hash_block_tokens(ROOT, block, salt_key(salt)))
    return [external_hash(h) for h in hashes]


def test_external_hash_is_the_digests_last_eight_bytes_unsigned():
    digest = bytes(range(24)) + bytes([0xff] * 8)
    assert external_hash(digest) == 2 ** 64 - 1
    assert external_hash(bytes(31) + b"\x05") == 5


def test_prefill_then_decode_store_each_block_once_with_its_parent():
    kv, events = make_kv()
    req = make_request("a", prompt_len=10)
    prefill(kv, req)
    h = chain(req.all_token_ids)
    assert events.take() == [BlockStored(tuple(h), None, tuple(req.all_token_ids[:8]), 4, "GPU", (None, None))]
    for t in (50, 51):  # tokens 11 and 12 fill block 2
        req.append_token(t)
    req.num_computed_tokens = 12
    kv.cache_blocks(req)
    h = chain(req.all_token_ids)
    assert events.take() == [BlockStored((h[2],), h[1], tuple(req.all_token_ids[8:12]), 4, "GPU", (None,))]
    kv.cache_blocks(req)
    assert events.take() == []


def test_eviction_reports_each_block_removed_coldest_first():
    kv, events = make_kv(num_blocks=4)
    a = make_request("a", prompt_len=9)
    prefill(kv, a)       # blocks 0, 1 cached; 2 holds one token
    ha = chain(a.all_token_ids)
    kv.free(a)           # freed tail first: 2, 1, 0 join the free queue in that order
    events.take()
    b = make_request("b", prompt_len=16, first_token=500)
    prefill(kv, b)       # takes 3, 2, 1, 0: evicts 1 then 0, then caches its four blocks
    hb = chain(b.all_token_ids)
    assert events.take() == [BlockRemoved((ha[1],), "GPU"), BlockRemoved((ha[0],), "GPU"),
                             BlockStored(tuple(hb), None, tuple(b.all_token_ids), 4, "GPU", (None,) * 4)]
    assert kv.pool.num_evictions == 2


def test_salt_rides_in_the_first_blocks_extra_keys_only():
    kv, events = make_kv()
    req = salted("s", "tenant-7", prompt_len=12)
    prefill(kv, req)
    [stored] = events.take()
    assert stored.extra_keys == (("tenant-7",), None, None)
    assert stored.block_hashes == tuple(chain(req.all_token_ids, salt="tenant-7"))
    assert stored.block_hashes != tuple(chain(req.all_token_ids))


def test_a_duplicate_block_is_not_reported_and_splits_the_run():
    kv, events = make_kv(num_blocks=10)
    a, b = make_request("a", prompt_len=9), make_request("b", prompt_len=9)
    for r in (a, b):     # both allocated before either is cached: no hits, two copies of the prefix
        kv.allocate_slots(r, r.num_tokens, [])
    a.num_computed_tokens = 9
    kv.cache_blocks(a)
    h = chain(a.all_token_ids)
    assert events.take() == [BlockStored(tuple(h), None, tuple(a.all_token_ids[:8]), 4, "GPU", (None, None))]
    b.all_token_ids[4:8] = [900, 901, 902, 903]   # b differs from block 1 on
    b.num_computed_tokens = 9
    kv.cache_blocks(b)
    hb = chain(b.all_token_ids)
    assert hb[0] == h[0] and hb[1] != h[1]
    # b's block 0 is a duplicate of a's (not cached); its block 1 is new and names the shared parent.
    assert events.take() == [BlockStored((hb[1],), h[0], (900, 901, 902, 903), 4, "GPU", (None,))]


def test_reset_prefix_cache_reports_all_blocks_cleared():
    kv, events = make_kv()
    req = make_request("a", prompt_len=8)
    prefill(kv, req)
    assert not kv.pool.reset_prefix_cache()      # a block is in use: nothing is cleared, nothing reported
    kv.free(req)
    events.take()
    assert kv.pool.reset_prefix_cache()
    assert events.take() == [AllBlocksCleared()]


def test_no_collector_and_no_caching_report_nothing():
    kv = KVCacheManager(8, 4, hash_root=ROOT)
    assert kv.pool.events is None
    prefill(kv, make_request("a", prompt_len=10))
    events = KVEventCollector(4)
    off = KVCacheManager(8, 4, enable_caching=False, hash_root=ROOT, kv_events=events)
    prefill(off, make_request("a", prompt_len=10))
    assert events.take() == []


def test_recorder_rejects_token_ids_that_do_not_fill_the_blocks():
    tier = KVEventCollector(4).tier("DISK")
    with pytest.raises(ValueError, match="need 8 token ids"):
        tier.stored([b"x" * 32, b"y" * 32], None, [1, 2, 3])
    with pytest.raises(ValueError, match="extra_keys"):
        tier.stored([b"x" * 32], None, [1, 2, 3, 4], [None, None])


def replay(events: list, holding: set[int]) -> None:
    # What a router's index does with the stream.
    for e in events:
        if isinstance(e, BlockStored):
            assert not holding & set(e.block_hashes), "a hash stored twice without a removal between"
            holding.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= holding, "removal of a hash never stored"
            holding.difference_update(e.block_hashes)
        else:
            holding.clear()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replayed_stream_equals_the_pools_cache_after_every_step(seed):
    rng = random.Random(seed)
    events = KVEventCollector(4)
    kv = KVCacheManager(24, 4, hash_root=ROOT, kv_events=events)
    sched = Scheduler(SchedulerConfig(6, 24), kv, 200)
    worker = WorkerMirror(sched)
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.choice((4, 9, 16)))] for _ in range(4)]
    holding: set[int] = set()
    for i in range(40):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 9))]
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            sched.add_request(Request(f"r{i}", prompt, params, rng.randint(1, 12)))
        if sched.has_unfinished():
            worker.step(token=rng.randrange(3, 1000))
        replay(events.take(), holding)
        assert holding == {external_hash(h) for h in kv.pool.cached}
    assert kv.pool.num_evictions > 0, "the run should evict"
