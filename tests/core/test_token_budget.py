"""The adaptive step budget and the long-prefill threshold, with exact plans."""
import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.token_budget import step_budget
from tests.core.helpers import WorkerMirror, make_request


def make_scheduler(most=2048, floor=512, threshold=512, max_num_seqs=16):
    config = SchedulerConfig(max_num_seqs, most, min_num_batched_tokens=floor,
                             long_prefill_token_threshold=threshold)
    return Scheduler(config, KVCacheManager(2000, 16, False), 100_000)


def decoding(n):
    reqs = [make_request(str(i), 8) for i in range(n)]
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1
    return reqs


@pytest.mark.parametrize("num_decoding, budget", [(0, 2048), (1, 1639), (2, 1367), (4, 1028), (8, 690), (12, 524),
                                                  (16, 528), (64, 576)])
def test_prefill_budget_shrinks_as_decodes_grow(num_decoding, budget):
    config = SchedulerConfig(64, 2048, min_num_batched_tokens=512)
    running = decoding(num_decoding) + [make_request("prefill", 100)]  # prefills do not shrink the budget
    assert step_budget(config, running) == budget


def test_drafts_come_on_top_and_the_maximum_holds():
    drafted = decoding(1)
    drafted[0].spec_token_ids = [5, 6]
    assert step_budget(SchedulerConfig(64, 2048, min_num_batched_tokens=512), drafted) == 1638 + 3
    assert step_budget(SchedulerConfig(64, 520, min_num_batched_tokens=512), decoding(64)) == 520


def test_fixed_budget_when_the_floor_is_the_maximum():
    for config in (SchedulerConfig(64, 512), SchedulerConfig(64, 512, min_num_batched_tokens=512)):
        assert [step_budget(config, decoding(n)) for n in (0, 4, 64)] == [512, 512, 512]


def steps_until_all_started(sched, num_prompts, prompt_len):
    for i in range(num_prompts):
        sched.add_request(make_request(f"r{i}", prompt_len, max_tokens=50))
    worker, totals = WorkerMirror(sched), []
    while any(not r.output_token_ids for r in sched.requests.values()):
        totals.append(worker.step()[0].total_num_scheduled_tokens)
    totals.append(worker.step()[0].total_num_scheduled_tokens)  # all 16 decode: the floor plus 16
    return totals


def test_a_burst_of_prompts_starts_in_fewer_steps_and_then_decodes_in_small_ones():
    # 16 prompts of 300 tokens: a fixed 512 needs 10 steps before the last one has its first token. The
    # adaptive budget takes 2048 while nothing decodes; then it counts decoding requests per prompt still
    # waiting for its first token: step 2 has 6 decoding and 10 prompts (9 waiting, 1 half done), so
    # 2048 * 40 / 46 + 6; step 3 has 12 decoding and 4 prompts: 2048 * 16 / 28 + 12, more than the 972 left.
    # Counting the decoding requests alone gave [2048, 825, 639, 557, 525, 260, 16]: 6 steps.
    assert steps_until_all_started(make_scheduler(), 16, 300) == [2048, 1786, 984, 16]
    assert steps_until_all_started(make_scheduler(512, 512), 16, 300) == [512] * 9 + [264, 16]


@pytest.mark.parametrize("max_num_seqs, plan", [
    # Room for all 4: 4 prompts against 12 decoding, 2048 * 16 / 28 = 1170 prefill tokens; the last gets 270.
    (16, {"p0": 300, "p1": 300, "p2": 300, "p3": 270}),
    # Room for 1: the waiting ones the batch cannot take do not count, one prompt gets the floor (512).
    (13, {"p0": 300}),
])
def test_prompts_the_batch_can_take_keep_the_budget_up(max_num_seqs, plan):
    sched = make_scheduler(max_num_seqs=max_num_seqs)
    for i in range(12):
        sched.add_request(make_request(f"d{i}", 20, max_tokens=50, first_token=100 * i))
    worker = WorkerMirror(sched)
    worker.step()  # the 12 prefill together, then all decode
    for i in range(4):
        sched.add_request(make_request(f"p{i}", 300, max_tokens=50, first_token=5000 + 1000 * i))
    _, scheduled = worker.step()
    assert {s.req_id: len(s.token_ids) for s in scheduled} == {**{f"d{i}": 1 for i in range(12)}, **plan}


def test_admissible_prompts_count_like_running_prefills():
    config = SchedulerConfig(64, 2048, min_num_batched_tokens=512)
    # 8 decoding, 8 prompts: 2048 * 32 / 40 = 1638 prefill tokens, plus the 8 decode tokens.
    assert step_budget(config, decoding(8), num_admissible=8) == 1646
    assert step_budget(config, decoding(8) + [make_request(f"p{i}", 100) for i in range(8)]) == 1646
    assert step_budget(config, decoding(8), num_admissible=1) == 690


@pytest.mark.parametrize("threshold, steps", [(512, 1), (0, 9)])
def test_a_short_prompt_does_not_wait_behind_a_long_one(threshold, steps):
    # A 20,000-token prompt is being prefilled when a 100-token one arrives. With the threshold the short one
    # starts in the next step and the long one takes what is left; without it, it waits ~20,000 / 2048 steps.
    sched = make_scheduler(threshold=threshold)
    sched.add_request(make_request("long", 20_000, max_tokens=4))
    worker = WorkerMirror(sched)
    _, [first] = worker.step()
    assert len(first.token_ids) == 2048  # alone, it takes the whole budget back
    sched.add_request(make_request("short", 100, max_tokens=4))
    plans = []
    while not sched.requests["short"].output_token_ids:
        plans.append({s.req_id: len(s.token_ids) for s in worker.step()[1]})
    assert len(plans) == steps
    if threshold:
        assert plans == [{"short": 100, "long": 1948}]
