"""GET /debug/kv's snapshot is exact on scripted scenarios (model-free), and block residency is sampled right."""
import json

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_pool import BlockPool, hash_block_tokens
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_residency import MAX_REUSE_GAPS, ResidencyEvent, ResidencySampler
from pagedserve.core.kv_snapshot import build_kv_snapshot
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams
from tests.core.helpers import WorkerMirror, make_request


def scheduler(num_blocks=16, block_size=4, host_blocks=0, mode="recompute"):
    kv = KVCacheManager(num_blocks, block_size, True, num_host_blocks=host_blocks)
    return Scheduler(SchedulerConfig(16, 256), kv, 1000, preemption_mode=mode)


def entry(block_id, state, holders=(), hashed=False):
    # What the snapshot must say about one block; the hash is checked against the pool separately.
    return {"id": block_id, "state": state, "ref_count": len(holders), "holders": list(holders), "hashed": hashed}


def summary(snap):
    return [{"id": b["id"], "state": b["state"], "ref_count": b["ref_count"], "holders": b["holders"],
             "hashed": b["hash"] is not None} for b in snap["blocks"]]


def check_consistent(snap, sched):
    # The JSON round-trips, hashes are the pool's, ref counts equal the number of tables listing a block.
    assert json.loads(json.dumps(snap)) == snap
    pool = sched.kv.pool
    for b in snap["blocks"]:
        block = pool.blocks[b["id"]]
        assert b["hash"] == (block.block_hash[:4].hex() if block.block_hash is not None else None)
        assert b["ref_count"] == len(b["holders"]) == block.ref_cnt
        for rid in b["holders"]:
            assert b["id"] in snap["requests"][rid]["block_ids"]
    assert snap["counters"]["num_in_use_blocks"] == sum(b["state"] == "in_use" for b in snap["blocks"])
    assert snap["counters"]["num_free_blocks"] == sum(b["state"] != "in_use" for b in snap["blocks"])


def test_four_samples_hold_their_full_prompt_blocks_once_with_ref_count_4():
    sched = scheduler()
    samples = [make_request(f"s{i}", prompt_len=10, max_tokens=3) for i in range(4)]
    sched.add_request(samples[0])
    for s in samples[1:]:
        sched.add_request(s, fork_of=samples[0])
    worker = WorkerMirror(sched)
    worker.step()   # s0 prefills blocks 0, 1 (full, hashed) and 2 (tokens 8..9)
    worker.schedule()  # the forks share 0, 1 and copy block 2 before writing token 9: blocks 3, 4, 5
    snap = build_kv_snapshot(sched)
    check_consistent(snap, sched)
    everyone = ["s0", "s1", "s2", "s3"]
    assert summary(snap) == [entry(0, "in_use", everyone, True), entry(1, "in_use", everyone, True),
                             entry(2, "in_use", ["s0"]), entry(3, "in_use", ["s1"]), entry(4, "in_use", ["s2"]),
                             entry(5, "in_use", ["s3"])] + [entry(i, "free") for i in range(6, 16)]
    assert {rid: r["block_ids"] for rid, r in snap["requests"].items()} == {
        "s0": [0, 1, 2], "s1": [0, 1, 3], "s2": [0, 1, 4], "s3": [0, 1, 5]}
    assert snap["requests"]["s0"]["status"] == "running"
    c = snap["counters"]
    assert (c["num_in_use_blocks"], c["num_shared_blocks"], c["num_cow_copies_total"], c["num_running"]) == (6, 2, 3, 4)
    assert (snap["num_blocks"], snap["block_size"], snap["swapped"]) == (16, 4, [])


def _system_prompt_request(req_id, suffix_first, max_tokens=2):
    # 8 system-prompt tokens (two blocks of 4) and 3 tokens of its own.
    prompt = [11, 12, 13, 14, 15, 16, 17, 18] + [suffix_first, suffix_first + 1, suffix_first + 2]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens, (2,))


def test_requests_on_one_system_prompt_share_one_set_of_cached_blocks_and_all_end_free():
    sched = scheduler()
    worker = WorkerMirror(sched)
    sched.add_request(_system_prompt_request("warm", 100, max_tokens=1))
    while sched.has_unfinished():
        worker.step()
    snap = build_kv_snapshot(sched)
    # The system prompt stays cached (evictable) after its request ended; its partial tail block is just free.
    assert summary(snap) == [entry(0, "cached", hashed=True), entry(1, "cached", hashed=True)] + [
        entry(i, "free") for i in range(2, 16)]
    system_hashes = [b["hash"] for b in snap["blocks"][:2]]

    ids = [f"r{i}" for i in range(8)]
    for i, rid in enumerate(ids):
        sched.add_request(_system_prompt_request(rid, 200 + 10 * i))
    worker.schedule()  # all eight hit blocks 0 and 1; each takes one block of its own from the free queue
    snap = build_kv_snapshot(sched)
    check_consistent(snap, sched)
    assert summary(snap) == [entry(0, "in_use", ids, True), entry(1, "in_use", ids, True), entry(2, "free")] + [
        entry(3 + i, "in_use", [rid]) for i, rid in enumerate(ids)] + [entry(i, "free") for i in range(11, 16)]
    assert [b["hash"] for b in snap["blocks"][:2]] == system_hashes
    assert snap["counters"]["prefix_cache_hits"] == 8 * 8
    assert snap["counters"]["prefix_cache_queries"] == 11 + 8 * 11

    while sched.has_unfinished():
        worker.step()
    snap = build_kv_snapshot(sched)
    check_consistent(snap, sched)
    assert [b for b in snap["blocks"] if b["state"] == "in_use"] == []
    assert snap["requests"] == {} and snap["counters"]["num_in_use_blocks"] == 0
    assert [b["state"] for b in snap["blocks"][:2]] == ["cached", "cached"]
    assert snap["counters"]["kv_cache_usage"] == 0.0


def test_swapped_blocks_are_listed_with_their_holder():
    sched = scheduler(num_blocks=4, block_size=4, host_blocks=8, mode="swap")
    a, b = make_request("a", 7, max_tokens=6), make_request("b", 7, max_tokens=6, first_token=50)
    sched.add_request(a)
    sched.add_request(b)
    worker = WorkerMirror(sched)
    while not sched.kv.swapped:
        worker.step()
    snap = build_kv_snapshot(sched)
    check_consistent(snap, sched)
    host_ids = [h.block_id for h in sched.kv.swapped["b"]]
    assert snap["swapped"] == [{"id": h, "state": "swapped", "ref_count": 1, "holders": ["b"], "hash": None}
                               for h in host_ids]
    assert snap["requests"]["b"] == {"status": "preempted", "num_tokens": b.num_tokens,
                                     "num_computed_tokens": b.num_computed_tokens, "block_ids": [],
                                     "swapped_block_ids": host_ids}
    assert snap["counters"]["num_preemptions_swap_total"] == 1
    assert snap["counters"]["num_swapped_out_blocks_total"] == len(host_ids) == 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_residency_follows_a_sampled_block_from_allocation_to_eviction():
    pool = BlockPool(2)
    clock = FakeClock()
    pool.residency = ResidencySampler(sample_every=1, clock=clock)
    [b0] = pool.allocate(1)
    pool.cache(b0, hash_block_tokens(b"root", [1, 2]))
    clock.now = 101.0
    pool.free([b0])
    clock.now = 103.0
    pool.touch([b0])            # a prefix hit: an access 3 s after the allocation
    pool.free([b0])
    clock.now = 104.5
    pool.touch([b0])            # 1.5 s later
    pool.free([b0])
    assert pool.residency.drain() == []  # still alive
    clock.now = 110.0
    pool.allocate(2)            # block 1, then block 0 is evicted and handed out again
    assert pool.residency.drain() == [ResidencyEvent(10.0, 5.5, (3.0, 1.5))]
    assert pool.num_evictions == 1


def test_a_block_that_never_held_cached_contents_records_no_eviction():
    pool = BlockPool(1)
    pool.residency = ResidencySampler(sample_every=1, clock=FakeClock())
    [b0] = pool.allocate(1)       # a partly filled tail block: never hashed
    pool.free([b0])
    pool.allocate(1)
    assert pool.residency.drain() == [] and pool.num_evictions == 0
    assert b0.residency is not None  # the new allocation is followed from scratch


def test_residency_samples_one_allocation_in_n_and_keeps_the_latest_gaps():
    pool = BlockPool(8)
    clock = FakeClock()
    pool.residency = ResidencySampler(sample_every=3, clock=clock)
    blocks = pool.allocate(8)
    assert [b.block_id for b in blocks if b.residency is not None] == [2, 5]
    b2 = blocks[2]
    for i in range(MAX_REUSE_GAPS + 2):
        clock.now += i + 1
        pool.touch([b2])
    assert b2.residency.reuse_gaps == [3.0, 4.0, 5.0, 6.0]
    assert BlockPool(4, enable_caching=False).residency is None  # the host swap pool is not sampled
    with pytest.raises(ValueError):
        ResidencySampler(sample_every=-1)
