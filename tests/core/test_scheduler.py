import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.request import RequestStatus
from tests.core.helpers import WorkerMirror, fake_run, make_request


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=32, caching=True, max_model_len=1000):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget), kv, max_model_len)


def test_chunked_prefill_then_decode_with_exact_plans():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", prompt_len=10, max_tokens=2))
    sched.add_request(make_request("b", prompt_len=3, max_tokens=2))
    worker = WorkerMirror(sched)
    p1, s1 = worker.schedule()
    assert [(s.req_id, len(s.token_ids), s.start_pos, s.block_ids, s.sample) for s in s1] == \
        [("a", 8, 0, [0, 1], False)]
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in p1.scheduled_new_reqs] == [("a", [0, 1], 0)]
    sched.update(p1, fake_run(s1))
    p2, s2 = worker.schedule()
    assert [(s.req_id, len(s.token_ids), s.start_pos, s.block_ids, s.sample) for s in s2] == \
        [("a", 2, 8, [0, 1, 2], True), ("b", 3, 0, [3], True)]
    # a is known to the worker: only its new block travels; b is new.
    c = p2.scheduled_cached_reqs
    assert (c.req_ids, c.new_token_ids, c.new_block_ids, c.num_computed_tokens) == (["a"], [[]], [[2]], [8])
    assert [r.req_id for r in p2.scheduled_new_reqs] == ["b"]
    assert p2.num_scheduled_tokens == {"a": 2, "b": 3} and p2.total_num_scheduled_tokens == 5
    sched.update(p2, fake_run(s2))
    p3, s3 = worker.schedule()
    assert [(s.req_id, s.token_ids, s.start_pos) for s in s3] == [("a", [7], 10), ("b", [7], 3)]
    # Each sampled token reaches the worker once, in the next plan; no block is new.
    c = p3.scheduled_cached_reqs
    assert (c.new_token_ids, c.new_block_ids, c.resumed_from_preemption) == ([[7], [7]], [[], []], [False, False])
    finished = sched.update(p3, fake_run(s3))
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in finished)
    assert not sched.has_unfinished() and sched.kv.pool.num_free_blocks == 16
    # The finished ids still reach the worker: a plan with nothing scheduled is not empty.
    p4, _ = worker.schedule()
    assert p4.finished_req_ids == ["a", "b"] and not p4.num_scheduled_tokens and not p4.is_empty
    assert not worker.tokens and sched.schedule().is_empty


def test_preempts_newest_by_recompute_and_resumes():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, caching=False)
    a, b = make_request("a", 8, max_tokens=6), make_request("b", 8, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    worker = WorkerMirror(sched)
    _, scheduled = worker.step()             # 8 tokens computed, 9th (sampled) needs a new block
    assert [s.block_ids for s in scheduled] == [[0, 1], [2, 3]]
    plan, scheduled = worker.step()          # a needs a 3rd block: b is preempted
    assert plan.preempted_req_ids == ["b"]
    assert [(s.req_id, s.block_ids) for s in scheduled] == [("a", [0, 1, 3])]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.output_token_ids == [7]
    assert list(sched.waiting) == [b]
    resumed = False
    while sched.has_unfinished():
        plan, _ = worker.step()
        c = plan.scheduled_cached_reqs
        if "b" in c.req_ids and c.resumed_from_preemption[c.req_ids.index("b")]:
            # The whole new table and the token sampled before the preemption, recomputed from 0.
            i = c.req_ids.index("b")
            assert (c.new_token_ids[i], c.num_computed_tokens[i], len(c.new_block_ids[i])) == ([7], 0, 3)
            resumed = True
    assert resumed
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert sched.num_preemptions_total >= 1 and sched.kv.pool.num_free_blocks == 4


def test_request_that_can_never_fit_is_rejected():
    sched = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="never fit"):
        sched.add_request(make_request("a", prompt_len=6, max_tokens=3))


def test_prefix_hits_skip_computed_tokens():
    sched = make_scheduler(block_size=4, budget=64)
    sched.add_request(make_request("a", prompt_len=9, max_tokens=1))
    worker = WorkerMirror(sched)
    worker.step()
    sched.add_request(make_request("b", prompt_len=9, max_tokens=1))
    plan, [s] = worker.schedule()
    assert (s.start_pos, len(s.token_ids), s.block_ids[:2]) == (8, 1, [0, 1])
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 8 and plan.num_scheduled_prompt_tokens == 1
    assert sched.requests["b"].num_cached_tokens == 8


def check_invariants(sched):
    pool = sched.kv.pool
    owners = Counter(b.block_id for blocks in sched.kv.req_blocks.values() for b in blocks)
    for block in pool.blocks:
        assert block.ref_cnt == owners.get(block.block_id, 0)
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
    for blocks in sched.kv.req_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks)  # never twice in one table
    for h, block in pool.cached.items():
        assert block.block_hash == h


def drive(sched, rng, reqs, abort_prob, mid_step=(), mid_step_prob=0.2) -> list:
    # mid_step: requests that arrive while a step is in flight (one in a step with probability mid_step_prob;
    # those left when all else is done arrive as the others do). The engine core then
    # asks for urgent plans between the step's layers (Scheduler.schedule_urgent) and runs them before it ends.
    # Returns those that ran.
    worker = WorkerMirror(sched)
    pending, later, urgent_plans = list(reqs), list(mid_step), []
    while pending or later or sched.has_unfinished():
        if not pending and not sched.has_unfinished():
            pending, later = later, []
        for _ in range(rng.randint(0, 4)):
            if pending:
                sched.add_request(pending.pop())
        if sched.requests and rng.random() < abort_prob:
            sched.finish_request(rng.choice(list(sched.requests)), RequestStatus.FINISHED_ABORTED)
        token = rng.randint(3, 50)
        plan, scheduled = worker.schedule()
        num_urgent = 0
        if later and plan.num_scheduled_tokens and rng.random() < mid_step_prob:
            sched.add_request(later.pop())
            for _ in range(2):  # asked at two layers
                in_flight = {r: sched.requests[r].priority for r in plan.num_scheduled_tokens}
                urgent = sched.schedule_urgent(plan)
                if urgent is None:
                    continue
                assert not urgent.preempted_req_ids and not set(urgent.num_scheduled_tokens) & set(in_flight)
                # each admitted request outranks the whole step: a strictly smaller priority
                assert all(sched.requests[r].priority < min(in_flight.values()) for r in urgent.num_scheduled_tokens)
                sched.update(urgent, fake_run(worker.apply(urgent), token))
                num_urgent += len(urgent.num_scheduled_tokens)
                urgent_plans.append(urgent)
        sched.update(plan, fake_run(scheduled, token))
        assert plan.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs + num_urgent
        check_invariants(sched)
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    assert not sched.kv.req_blocks
    worker.schedule()                  # the last finished ids: the worker then holds nothing
    assert not worker.tokens
    return urgent_plans


def test_thousand_random_requests_return_every_block():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=6, budget=24)
    reqs = [make_request(str(i), rng.randint(1, 40), rng.randint(1, 30), first_token=rng.choice([0, 0, 5, i]))
            for i in range(1000)]
    drive(sched, rng, reqs, abort_prob=0.05)
    assert sched.num_preemptions_total > 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(6, 30), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 40), caching=st.booleans())
def test_random_schedules_keep_invariants(seed, num_blocks, block_size, budget, caching):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks, block_size, rng.randint(1, 5), budget, caching)
    cap = num_blocks * block_size
    reqs = []
    for i in range(30):
        max_tokens = rng.randint(1, max(1, cap // 3))
        prompt_len = rng.randint(1, max(1, cap - max_tokens))
        reqs.append(make_request(str(i), prompt_len, max_tokens, first_token=rng.choice([0, i])))
    drive(sched, rng, reqs, abort_prob=0.1)
