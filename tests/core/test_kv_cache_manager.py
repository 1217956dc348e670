from pagedserve.core.kv_cache_manager import KVCacheManager
from tests.core.helpers import make_request


def test_blocks_are_taken_on_demand_one_at_a_time():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", prompt_len=6)
    assert kv.allocate_slots(req, 6) == [0, 1]
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 1) == []      # slot 7 of block 1
    req.num_computed_tokens = 7
    assert kv.allocate_slots(req, 1) == []
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1) == [2]     # token 9 opens a third block
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free(req)
    assert kv.pool.num_free_blocks == 8


def test_allocate_returns_none_when_short_and_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = make_request("a", prompt_len=9)
    assert kv.allocate_slots(req, 9) is None
    assert kv.pool.num_free_blocks == 2 and kv.block_ids("a") == []


def test_prefix_hit_reuses_full_blocks_and_recomputes_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", prompt_len=10)
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_blocks(a)
    assert len(kv.pool.cached) == 2              # blocks 0 and 1 full, block 2 partial
    b = make_request("b", prompt_len=12)         # same first 10 tokens, then more
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert kv.allocate_slots(b, 4, hits) == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # A prompt that is exactly the cached blocks still recomputes its last token.
    c = make_request("c", prompt_len=8)
    hits, n = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0] and n == 4


def test_prompt_logprobs_request_fills_the_cache_but_never_reads_it():
    # Its cached positions would not be computed, so their prompt logprobs would be missing.
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", prompt_len=10)
    a.params.prompt_logprobs = 1
    assert kv.get_computed_blocks(a) == ([], 0)
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_blocks(a)
    assert len(kv.pool.cached) == 2
    b = make_request("b", prompt_len=10)
    b.params.prompt_logprobs = 0
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.record_prefix_query(b, 0)
    assert kv.prefix_stats.num_queries == 0      # it never asked the cache
    c = make_request("c", prompt_len=10)         # an ordinary request still hits a's blocks
    assert kv.get_computed_blocks(c)[1] == 8


def test_free_blocks_stay_cached_and_count_against_allocation():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", prompt_len=9)
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_blocks(a)
    kv.free(a)
    assert list(kv.pool.free_queue) == [2, 1, 0]
    b = make_request("b", prompt_len=9)
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    # b needs 1 more block; 3 free but 2 of them are its own hits.
    assert kv.allocate_slots(b, 1, hits) == [2]
    assert kv.pool.num_free_blocks == 0
