import pytest

from pagedserve.core.block_pool import BlockPool, hash_block_tokens

ROOT = b"test-root"


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_takes_lowest_ids_first_and_free_appends_in_given_order():
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert ids(a) == [0, 1, 2]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.num_free_blocks == 3
    pool.free(list(reversed(a)))
    assert list(pool.free_queue) == [3, 4, 5, 2, 1, 0]
    assert ids(pool.allocate(4)) == [3, 4, 5, 2]


def test_cached_free_block_is_found_and_revived_until_evicted():
    pool = BlockPool(3)
    [b0, b1] = pool.allocate(2)
    h0 = hash_block_tokens(ROOT, [1, 2, 3, 4])
    pool.cache(b0, h0)
    pool.free([b1, b0])
    assert pool.lookup(h0) is b0 and b0.ref_cnt == 0
    pool.touch([b0])                      # a prefix hit takes it back out of the free queue
    assert b0.ref_cnt == 1 and 0 not in pool.free_queue
    pool.touch([b0])
    assert b0.ref_cnt == 2
    pool.free([b0])
    pool.free([b0])
    assert list(pool.free_queue) == [2, 1, 0]
    assert ids(pool.allocate(2)) == [2, 1]
    assert pool.lookup(h0) is b0          # not yet evicted
    assert ids(pool.allocate(1)) == [0]   # LRU eviction reuses it
    assert pool.lookup(h0) is None and pool.num_evictions == 1


def test_hash_chains_parent():
    h_a = hash_block_tokens(ROOT, [1, 2])
    assert hash_block_tokens(h_a, [3, 4]) != hash_block_tokens(hash_block_tokens(ROOT, [9, 9]), [3, 4])
    assert hash_block_tokens(h_a, [3, 4]) == hash_block_tokens(hash_block_tokens(ROOT, [1, 2]), [3, 4])


def test_double_free_and_overallocation_are_caught():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])
    with pytest.raises(ValueError):
        BlockPool(2).allocate(3)


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    b0, b1 = pool.allocate(2)
    h = hash_block_tokens(ROOT, [5])
    pool.cache(b0, h)
    pool.cache(b1, h)
    assert pool.lookup(h) is b0 and b1.block_hash is None


def test_caching_disabled_never_registers():
    pool = BlockPool(2, enable_caching=False)
    [b] = pool.allocate(1)
    pool.cache(b, hash_block_tokens(ROOT, [1]))
    assert pool.cached == {}
