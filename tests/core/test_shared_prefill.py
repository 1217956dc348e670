"""Requests whose prompt prefix a running prefill is computing wait for its blocks instead of computing them again
(core/scheduler.py, _waits_for_running_prefill), with exact plans and prefix-cache hit counts."""
import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams
from tests.core.helpers import WorkerMirror

PREFIX = [3 + i % 900 for i in range(1000)]  # 62 full blocks of 16 and 8 tokens


def shared_request(i: int, suffix_len: int = 40, prefix=PREFIX, priority: int = 0) -> Request:
    suffix = [1000 + 100 * i + j for j in range(suffix_len)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    req = Request(f"r{i}", prefix + suffix, params, 4, eos_token_ids=(2,))
    req.priority = priority
    return req


def make_scheduler(policy="fcfs", max_num_seqs=16):
    config = SchedulerConfig(max_num_seqs, 2048, min_num_batched_tokens=512, long_prefill_token_threshold=512,
                             scheduling_policy=policy)
    return Scheduler(config, KVCacheManager(2000, 16, True), 100_000)


def plans_until_all_started(sched):
    worker, plans = WorkerMirror(sched), []
    while any(not r.output_token_ids for r in sched.requests.values()):
        plans.append({s.req_id: len(s.token_ids) for s in worker.step()[1]})
    return plans


def test_a_burst_on_one_cold_prefix_computes_it_once():
    # 8 requests sent together, a cold 1,000-token prefix and 40 tokens each of their own. r0 computes the
    # prefix (its 512-token cap topped up with the budget the others leave); r1..r7 wait one step, then find its
    # 62 full blocks cached and compute 48 tokens each. Before, r0..r3 computed the prefix side by side (two steps
    # of 4 x 512) and only r4..r7 hit it: first tokens after 3 steps, 4,352 prefill tokens instead of 1,376.
    sched = make_scheduler()
    for i in range(8):
        sched.add_request(shared_request(i))
    assert plans_until_all_started(sched) == [{"r0": 1040}, {"r0": 1, **{f"r{i}": 48 for i in range(1, 8)}}]
    stats = sched.kv.prefix_stats
    assert (stats.num_queries, stats.num_hits) == (8 * 1040, 7 * 992)


def test_a_prefix_longer_than_the_budget_is_waited_for_until_it_is_cached():
    # A 3,000-token prefix: r0 needs two steps of 2,048 tokens; r1 waits for both, then hits 187 blocks.
    prefix = [3 + i % 900 for i in range(3000)]
    sched = make_scheduler()
    for i in range(2):
        sched.add_request(shared_request(i, prefix=prefix))
    assert plans_until_all_started(sched) == [{"r0": 2048}, {"r0": 992}, {"r0": 1, "r1": 48}]
    assert sched.kv.prefix_stats.num_hits == 2992


def test_other_prompts_are_admitted_while_one_waits():
    # r1 waits for r0's prefix; r9, behind it with a prompt of its own, starts at once.
    sched = make_scheduler()
    sched.add_request(shared_request(0))
    sched.add_request(shared_request(1))
    sched.add_request(shared_request(9, prefix=[950 + i % 40 for i in range(200)]))
    plans = plans_until_all_started(sched)
    assert plans == [{"r0": 1040, "r9": 240}, {"r0": 1, "r9": 1, "r1": 48}]
    # r1 kept its place: it is still ahead of requests that arrive later.
    assert [r.req_id for r in sched.waiting] == []


@pytest.mark.parametrize("suffix_len, waits", [(40, True), (1100, False)])
def test_it_waits_only_when_the_shared_part_is_at_least_half_its_prefill(suffix_len, waits):
    # r1's own part is 1,100 tokens: the 992 it could share are less than half of its 2,140, so it starts at once
    # instead of waiting a step (both capped at 512, then topped up in order: r0 all 1,040, r1 the 496 left).
    sched = make_scheduler()
    sched.add_request(shared_request(0))
    sched.add_request(shared_request(1, suffix_len=suffix_len))
    first = plans_until_all_started(sched)[0]
    assert first == ({"r0": 1040} if waits else {"r0": 1040, "r1": 1008})


def test_a_more_urgent_request_does_not_wait_for_the_one_it_pauses():
    # Priority policy: r1 outranks r0, whose prefill of a 3,000-token prefix is half done, so r0 pauses for r1
    # (docs/scheduling.md); r1 must not wait for r0 in turn, or neither would run. r1 hits r0's first 128
    # blocks and computes the rest itself.
    prefix = [3 + i % 900 for i in range(3000)]
    sched = make_scheduler("priority")
    sched.add_request(shared_request(0, prefix=prefix, priority=1))
    worker = WorkerMirror(sched)
    assert {s.req_id: len(s.token_ids) for s in worker.step()[1]} == {"r0": 2048}
    sched.add_request(shared_request(1, prefix=prefix, priority=0))
    assert {s.req_id: len(s.token_ids) for s in worker.step()[1]} == {"r1": 992}
