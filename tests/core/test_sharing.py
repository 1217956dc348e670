"""Forks share blocks and copy on write; swapping moves blocks to the host pool and back (exact ids)."""
import random

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler
from tests.core.helpers import WorkerMirror, make_request
from tests.core.test_scheduler import check_invariants


def scheduler(num_blocks=16, block_size=4, host_blocks=0, mode="recompute", budget=64, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching, num_host_blocks=host_blocks)
    return Scheduler(SchedulerConfig(8, budget), kv, 1000, preemption_mode=mode)


def test_fork_shares_prompt_blocks_and_copies_the_partial_one():
    sched = scheduler()
    a = make_request("a", prompt_len=6, max_tokens=3)
    b = make_request("b", prompt_len=6, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b, fork_of=a)
    worker = WorkerMirror(sched)
    _, s1 = worker.step()
    assert [s.req_id for s in s1] == ["a"]       # b waits for a's prefill
    assert sched.stats().num_waiting == 1
    p2, s2 = worker.step()
    plans = {s.req_id: s for s in s2}
    assert plans["a"].block_ids == [0, 1] and plans["a"].token_ids == [7]
    # b shares block 0 (full) and block 1 (tokens 4..5 of 6); it rewrites slot 5, so block 1 is copied.
    assert (plans["b"].start_pos, plans["b"].token_ids, plans["b"].block_ids) == (5, [a.prompt_token_ids[5]], [0, 2])
    assert p2.block_ops.copy == [(1, 2)]
    assert [r.num_computed_tokens for r in p2.scheduled_new_reqs] == [5]
    assert [sched.kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]
    assert sched.stats().num_shared_blocks == 1 and sched.stats().num_cow_copies_total == 1
    while sched.has_unfinished():
        worker.step()
    assert sched.kv.pool.num_free_blocks == 16


def test_fork_on_block_boundary_needs_no_copy():
    sched = scheduler()
    a = make_request("a", prompt_len=5, max_tokens=2)
    b = make_request("b", prompt_len=5, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b, fork_of=a)
    worker = WorkerMirror(sched)
    worker.step()
    p2, s2 = worker.schedule()
    plans = {s.req_id: s for s in s2}
    assert plans["b"].block_ids == [0, 2] and p2.block_ops.copy == []


def test_aborting_the_source_releases_its_forks():
    sched = scheduler()
    a, b = make_request("a", 6), make_request("b", 6)
    sched.add_request(a)
    sched.add_request(b, fork_of=a)
    sched.finish_request("a", a.status.FINISHED_ABORTED)
    plan, scheduled = WorkerMirror(sched).schedule()
    assert [(s.req_id, s.start_pos) for s in scheduled] == [("b", 0)]
    assert plan.finished_req_ids == []   # a never reached the worker
    check_invariants(sched)


def test_fork_of_a_finished_source_falls_back_to_prefix_cache():
    sched = scheduler()
    a, b = make_request("a", 6, max_tokens=1), make_request("b", 6, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b, fork_of=a)
    worker = WorkerMirror(sched)
    worker.step()                         # a finishes at once; its full block 0 stays cached
    p, [s] = worker.schedule()
    assert (s.req_id, s.start_pos, s.block_ids) == ("b", 4, [0, 2])
    assert p.finished_req_ids == ["a"]


def test_swap_out_and_in_keeps_computed_tokens():
    sched = scheduler(num_blocks=4, block_size=4, host_blocks=4, mode="swap")
    # Prompts of their own: b would otherwise wait for a's prefill of the same blocks.
    a, b = make_request("a", 8, max_tokens=3), make_request("b", 8, max_tokens=3, first_token=100)
    sched.add_request(a)
    sched.add_request(b)
    worker = WorkerMirror(sched)
    worker.step()
    p, _ = worker.step()
    assert p.preempted_req_ids == ["b"]
    assert p.block_ops.swap_out == [(2, 0), (3, 1)]
    assert b.num_computed_tokens == 8 and sched.kv.is_swapped(b)
    while not sched.kv.swapped == {} or a in sched.running:
        p, scheduled = worker.step()
        if p.block_ops.swap_in:
            assert len(p.block_ops.swap_in) == 2 and [h for h, _ in p.block_ops.swap_in] == [0, 1]
            [s] = [s for s in scheduled if s.req_id == "b"]
            assert s.start_pos == 8 and len(s.token_ids) == 1
            c = p.scheduled_cached_reqs
            assert c.resumed_from_preemption[c.req_ids.index("b")]
            assert s.block_ids[:2] == [d for _, d in p.block_ops.swap_in]
    while sched.has_unfinished():
        worker.step()
    assert sched.stats().num_preemptions_swap_total == 1
    assert sched.kv.pool.num_free_blocks == 4 and sched.kv.host_pool.num_free_blocks == 4


def test_random_forks_and_swaps_leak_nothing():
    rng = random.Random(1)
    for mode in ("recompute", "swap"):
        sched = scheduler(num_blocks=20, block_size=4, host_blocks=8, mode=mode, budget=16)
        worker = WorkerMirror(sched)
        pending = []
        for i in range(200):
            n = rng.choice([1, 1, 2, 4])
            first = make_request(f"{i}.0", rng.randint(1, 20), rng.randint(1, 20), first_token=i)
            pending.append((first, None))
            pending += [(make_request(f"{i}.{k}", first.num_prompt_tokens, first.max_tokens, first_token=i), first)
                        for k in range(1, n)]
        while pending or sched.has_unfinished():
            for _ in range(rng.randint(0, 6)):
                if pending:
                    req, src = pending.pop(0)
                    sched.add_request(req, fork_of=src)
            if sched.requests and rng.random() < 0.05:
                sched.finish_request(rng.choice(list(sched.requests)), sched.requests[next(iter(sched.requests))].status.FINISHED_ABORTED)
            worker.step(token=rng.randint(3, 9))
            check_invariants(sched)
        assert sched.kv.pool.num_free_blocks == 20 and not sched.kv.swapped
        assert not sched.pending_forks and not sched.fork_source
        assert sched.kv.num_cow_copies > 0
