"""Waiting-queue order (fair between client requests), the priority policy, its preemption and aging."""
import random

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduling_policy import TURN_STEPS
from tests.core.helpers import WorkerMirror, fake_run, make_request
from tests.core.test_scheduler import drive


def make_scheduler(policy="fcfs", num_blocks=64, max_num_seqs=2, budget=64, aging=100, mode="recompute"):
    kv = KVCacheManager(num_blocks, 4, False, num_host_blocks=64 if mode == "swap" else 0)
    config = SchedulerConfig(max_num_seqs, budget, scheduling_policy=policy, priority_aging_steps=aging)
    return Scheduler(config, kv, 1000, preemption_mode=mode)


def req(req_id, prompt_len=4, max_tokens=2, priority=0, client=None):
    r = make_request(req_id, prompt_len, max_tokens)
    r.priority, r.client_request_id = priority, client
    return r


def admitted_order(sched, steps, arrivals=None, worker=None):
    # Runs `steps` steps, adding arrivals[step] before each; returns request ids in order of first admission.
    worker, order = worker or WorkerMirror(sched), []
    for step in range(steps):
        for r in (arrivals or {}).get(step, ()):
            sched.add_request(r)
        plan, _ = worker.step()
        order += [n.req_id for n in plan.scheduled_new_reqs]
    return order


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_later_request_interleaves_with_a_big_one(policy):
    # 40 sequences of one client request, two at a time, two steps each; b arrives at step 3. Without
    # fairness b would start after all 40 (about step 40); it starts with the second pair's successors.
    sched = make_scheduler(policy)
    for i in range(40):
        sched.add_request(req(f"a{i}", client="A"))
    order = admitted_order(sched, 8, {3: [req("b")]})
    assert order == ["a0", "a1", "a2", "a3", "b", "a4", "a5", "a6"]


def test_single_requests_are_first_come_first_served():
    sched = make_scheduler(max_num_seqs=1)
    order = admitted_order(sched, 12, {0: [req("x"), req("y")], 1: [req("z")], 2: [req("w", client="W")]})
    assert order == ["x", "y", "z", "w"]


def test_priority_orders_the_queue_and_fcfs_ignores_it():
    arrivals = {0: [req("low", priority=2), req("mid", priority=1), req("high", priority=-1), req("mid2", priority=1)]}
    assert admitted_order(make_scheduler("priority", max_num_seqs=1), 8, arrivals) == ["high", "mid", "mid2", "low"]
    arrivals = {0: [req("low", priority=2), req("mid", priority=1), req("high", priority=-1), req("mid2", priority=1)]}
    assert admitted_order(make_scheduler("fcfs", max_num_seqs=1), 8, arrivals) == ["low", "mid", "high", "mid2"]


def test_urgent_request_preempts_the_least_urgent_when_the_batch_is_full():
    sched = make_scheduler("priority", max_num_seqs=2)
    sched.add_request(req("l1", max_tokens=20, priority=5))
    sched.add_request(req("l2", max_tokens=20, priority=3))
    worker = WorkerMirror(sched)
    worker.step()
    worker.step()
    sched.add_request(req("h", max_tokens=20, priority=0))
    plan, scheduled = worker.step()
    # l1 (priority 5) makes room; h is prefilled in the same step, l2 keeps decoding.
    assert plan.preempted_req_ids == ["l1"]
    assert [(s.req_id, len(s.token_ids)) for s in scheduled] == [("l2", 1), ("h", 4)]
    assert sched.requests["l1"].status is RequestStatus.PREEMPTED and list(sched.waiting) == [sched.requests["l1"]]
    # Equal or lower priority never preempts: m waits for a free slot.
    sched.add_request(req("m", max_tokens=1, priority=3))
    plan, _ = worker.step()
    assert not plan.preempted_req_ids and set(plan.num_scheduled_tokens) == {"l2", "h"}
    assert [r.req_id for r in sched.waiting] == ["m", "l1"]


def test_preempted_for_a_full_batch_pauses_and_resumes_without_recompute():
    # The pool has room, only the batch is full: l1 keeps its blocks and computed tokens while h runs, and
    # comes back computing one token (the recompute mode would compute all 5 again).
    sched = make_scheduler("priority", max_num_seqs=2)
    sched.add_request(req("l1", max_tokens=20, priority=5))
    sched.add_request(req("l2", max_tokens=20, priority=3))
    worker = WorkerMirror(sched)
    for _ in range(3):
        worker.step()
    blocks, computed = list(sched.kv.block_ids("l1")), sched.requests["l1"].num_computed_tokens
    assert computed == 5  # l2's prompt first, l1's in the next step (policy.holds_back), then one token
    sched.add_request(req("h", max_tokens=2, priority=0))
    plan, _ = worker.step()
    assert plan.preempted_req_ids == ["l1"] and list(sched.paused) == ["l1"]
    assert sched.kv.block_ids("l1") == blocks and sched.requests["l1"].num_computed_tokens == computed
    plan, _ = worker.step()  # h's last token: it finishes
    assert "h" not in sched.requests
    plan, scheduled = worker.step()
    assert [(s.req_id, len(s.token_ids)) for s in scheduled] == [("l2", 1), ("l1", 1)]
    assert sched.kv.block_ids("l1")[:len(blocks)] == blocks and not sched.paused


def test_paused_requests_take_turns_with_their_priority():
    # h (20 tokens) pauses one of two equal low-priority requests. Alone, that one would fall 20 steps behind
    # (and finish 20 steps after the other); taking turns every TURN_STEPS + 1 steps, neither falls further
    # behind than that, and a turn only moves rows: each step computes one token per running request.
    sched = make_scheduler("priority", max_num_seqs=2)
    for name in ("l1", "l2"):
        sched.add_request(req(name, max_tokens=60, priority=5))
    worker = WorkerMirror(sched)
    for _ in range(3):
        worker.step()
    sched.add_request(req("h", max_tokens=20, priority=0))
    lows = [sched.requests["l1"], sched.requests["l2"]]
    gaps, turns = [], 0
    while "h" in sched.requests:
        plan, scheduled = worker.step()
        assert all(len(s.token_ids) == 1 for s in scheduled if s.req_id != "h")  # no recompute
        assert "h" in [s.req_id for s in scheduled]
        turns += len(plan.preempted_req_ids)
        gaps.append(abs(lows[0].num_output_tokens - lows[1].num_output_tokens))
    assert max(gaps) <= TURN_STEPS + 1 and turns >= 3
    worker.step()  # the one paused when h finished comes back
    assert not sched.paused and len(sched.running) == 2


def test_paused_requests_give_their_blocks_back_before_a_running_one_is_preempted():
    # 8 blocks of 4 tokens. l1 and l2 hold 3 blocks each when h pauses l1 (2 free: h's prompt takes 1). As l2
    # and h grow the pool runs short: l1 (paused) gives its 3 blocks back, no running request is preempted, and
    # l1 is computed again later.
    sched = make_scheduler("priority", num_blocks=8, max_num_seqs=2)
    sched.add_request(req("l1", 8, max_tokens=12, priority=5))
    sched.add_request(req("l2", 8, max_tokens=12, priority=3))
    worker = WorkerMirror(sched)
    for _ in range(3):  # l2's prompt, then l1's (policy.holds_back), then a token each
        worker.step()
    sched.add_request(req("h", 4, max_tokens=8, priority=0))
    plan, _ = worker.step()
    assert plan.preempted_req_ids == ["l1"] and len(sched.kv.block_ids("l1")) == 3
    dropped_at = None
    for step in range(12):
        plan, _ = worker.step()
        assert not plan.preempted_req_ids and set(plan.num_scheduled_tokens) == {"l2", "h"}
        if dropped_at is None and "l1" not in sched.paused:
            dropped_at = step
            assert not sched.kv.block_ids("l1") and sched.requests["l1"].num_computed_tokens == 0
        if "h" not in sched.requests:
            break
    assert dropped_at is not None
    while sched.has_unfinished():
        worker.step()
    assert sched.kv.pool.num_free_blocks == 8


def test_fcfs_never_preempts_for_a_waiting_request():
    sched = make_scheduler("fcfs", max_num_seqs=1)
    sched.add_request(req("l", max_tokens=5))
    worker = WorkerMirror(sched)
    worker.step()
    sched.add_request(req("h", priority=0))
    plan, _ = worker.step()
    assert not plan.preempted_req_ids and list(plan.num_scheduled_tokens) == ["l"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_urgent_request_preempts_when_the_pool_is_full(mode):
    # 6 blocks of 4 tokens: two 8-token prompts hold 4 blocks and grow; h needs 2 blocks for its prompt.
    sched = make_scheduler("priority", num_blocks=6, max_num_seqs=4, mode=mode)
    sched.add_request(req("l1", 8, max_tokens=8, priority=1))
    sched.add_request(req("l2", 8, max_tokens=8, priority=1))
    worker = WorkerMirror(sched)
    for _ in range(2):
        worker.step()
    assert sched.kv.pool.num_free_blocks == 0
    sched.add_request(req("h", 8, max_tokens=2, priority=0))
    plan, scheduled = worker.step()
    # The newer of the two equals (l2, blocks 2, 3, 5) goes; its blocks go to h.
    assert plan.preempted_req_ids == ["l2"]
    assert [(s.req_id, len(s.token_ids), s.block_ids) for s in scheduled] == [("l1", 1, [0, 1, 4]), ("h", 8, [5, 3])]
    if mode == "swap":
        assert [src for src, _ in plan.block_ops.swap_out] == [2, 3, 5]
    while sched.has_unfinished():
        worker.step()
    assert sched.requests == {} and sched.kv.pool.num_free_blocks == 6


def test_running_prefill_pauses_for_an_outranking_request():
    # l's 40-token prompt goes 8 tokens a step; h arrives and takes the budget until its prompt is done, and
    # the step that finishes it carries none of l's (h's first token comes after that step).
    sched = make_scheduler("priority", max_num_seqs=4, budget=8)
    sched.add_request(req("l", 40, max_tokens=2, priority=1))
    worker = WorkerMirror(sched)
    worker.step()
    sched.add_request(req("h", 12, max_tokens=2, priority=0))
    steps = [[(s.req_id, len(s.token_ids)) for s in worker.step()[1]] for _ in range(4)]
    assert steps == [[("h", 8)], [("h", 4)], [("h", 1), ("l", 7)], [("l", 8)]]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_step_with_an_urgent_prompt_carries_no_less_urgent_prompt(policy):
    # l0 decodes; h's prompt and two less urgent ones arrive together, and the budget (64) has room for all.
    # Under the priority policy h's step computes h's prompt and l0's token only: h's first token waits for
    # no other prompt. The others start one step later. fcfs takes them all at once.
    sched = make_scheduler(policy, max_num_seqs=4, budget=64)
    sched.add_request(req("l0", 8, max_tokens=10, priority=5))
    worker = WorkerMirror(sched)
    worker.step()
    for r in (req("h", 8, max_tokens=4, priority=0), req("l1", 8, priority=5), req("l2", 8, priority=5)):
        sched.add_request(r)
    steps = [sorted((s.req_id, len(s.token_ids)) for s in worker.step()[1]) for _ in range(2)]
    if policy == "priority":
        assert steps == [[("h", 8), ("l0", 1)], [("h", 1), ("l0", 1), ("l1", 8), ("l2", 8)]]
    else:
        assert steps == [[("h", 8), ("l0", 1), ("l1", 8), ("l2", 8)], [("h", 1), ("l0", 1), ("l1", 1), ("l2", 1)]]


def test_aging_bounds_the_wait_of_a_low_priority_request():
    # One slot; a new priority-0 request arrives every step. With aging_steps=3 the priority-2 request ranks
    # with those arriving 6 steps after it, so it is admitted after the ones that came before step 6.
    sched = make_scheduler("priority", max_num_seqs=1, aging=3)
    arrivals = {s: [req(f"h{s}", max_tokens=1, priority=0)] for s in range(12)}
    arrivals[0] = [req("low", max_tokens=1, priority=2), *arrivals[0]]
    order = admitted_order(sched, 12, arrivals)
    assert order[:8] == ["h0", "h1", "h2", "h3", "h4", "h5", "low", "h6"]


def test_aged_request_is_not_preempted_by_the_priority_it_aged_into():
    # low waits 6 steps behind h0: more than one level at aging_steps=4, so it runs as urgent as priority 0
    # requests arriving now; a priority -1 request still outranks it.
    sched = make_scheduler("priority", max_num_seqs=1, aging=4)
    sched.add_request(req("h0", max_tokens=6, priority=0))
    sched.add_request(req("low", max_tokens=6, priority=1))
    worker = WorkerMirror(sched)
    while "low" not in worker.tokens:
        worker.step()
    sched.add_request(req("h1", max_tokens=2, priority=0))
    plan, _ = worker.step()
    assert not plan.preempted_req_ids and list(plan.num_scheduled_tokens) == ["low"]
    sched.add_request(req("urgent", max_tokens=2, priority=-1))
    plan, _ = worker.step()
    assert plan.preempted_req_ids == ["low"] and list(plan.num_scheduled_tokens) == ["urgent"]
    # low waits again with its key moved back by the 2 steps it ran (4 -> 6): ahead of h1 (7), so it resumes
    # once urgent is done; 2 steps later h1, waiting all along, is the more urgent and preempts it.
    assert [r.req_id for r in sched.waiting] == ["low", "h1"]
    plans = [worker.step()[0] for _ in range(12)]
    events = [(i, "preempt", rid) for i, p in enumerate(plans) for rid in p.preempted_req_ids]
    events += [(i, "new", r.req_id) for i, p in enumerate(plans) for r in p.scheduled_new_reqs]
    events += [(i, "resume", rid) for i, p in enumerate(plans) for rid, resumed in
               zip(p.scheduled_cached_reqs.req_ids, p.scheduled_cached_reqs.resumed_from_preemption) if resumed]
    assert sorted(events) == [(1, "resume", "low"), (3, "new", "h1"), (3, "preempt", "low"), (5, "resume", "low")]
    assert not sched.has_unfinished()


def test_a_long_running_low_priority_job_stays_preemptible():
    # Running does not age a request: after 30 steps of decoding l is still preempted by a priority 0 arrival.
    sched = make_scheduler("priority", max_num_seqs=1, aging=4)
    sched.add_request(req("l", max_tokens=40, priority=1))
    worker = WorkerMirror(sched)
    for _ in range(30):
        worker.step()
    sched.add_request(req("h", max_tokens=2, priority=0))
    plan, _ = worker.step()
    assert plan.preempted_req_ids == ["l"] and list(plan.num_scheduled_tokens) == ["h"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_priorities_keep_invariants(mode):
    rng = random.Random(1)
    sched = make_scheduler("priority", num_blocks=24, max_num_seqs=5, budget=24, aging=7, mode=mode)
    reqs = []
    for i in range(300):
        r = req(str(i), rng.randint(1, 40), rng.randint(1, 30), priority=rng.randint(-2, 2),
                client=rng.choice([None, "A", "B"]))
        reqs.append(r)
    drive(sched, rng, reqs, abort_prob=0.05)
    assert sched.num_preemptions_total > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_urgent_steps_keep_invariants(mode):
    # A low-priority load (priority 3) and urgent requests (priority -1..1) arriving while steps are in flight,
    # which ask for urgent plans between their layers (drive's mid_step): the blocks and the worker's view stay
    # right, and urgent plans do run.
    rng = random.Random(2)
    sched = make_scheduler("priority", num_blocks=48, max_num_seqs=4, budget=24, aging=100, mode=mode)
    load = [req(f"l{i}", rng.randint(1, 40), rng.randint(1, 30), priority=3, client=rng.choice([None, "A"]))
            for i in range(200)]
    urgent = [req(f"u{i}", rng.randint(1, 30), rng.randint(1, 10), priority=rng.randint(-1, 1)) for i in range(40)]
    ran = drive(sched, rng, load, abort_prob=0.05, mid_step=urgent)
    assert sum(bool(p.num_scheduled_tokens) for p in ran) >= 15


def test_an_urgent_request_runs_between_the_layers_of_a_step():
    # A step prefills l1 and l2 (priority 5, the batch full); h (priority 0) arrives while it runs. Its urgent
    # plan holds h alone, beside the step, which it does not touch; the next step pauses l2, the least urgent,
    # to bring the batch back to max_num_seqs.
    sched = make_scheduler("priority", max_num_seqs=2)
    sched.add_request(req("l1", prompt_len=20, max_tokens=20, priority=5))
    sched.add_request(req("l2", prompt_len=20, max_tokens=20, priority=5))
    worker = WorkerMirror(sched)
    plan, scheduled = worker.schedule()
    assert plan.num_scheduled_tokens == {"l1": 20, "l2": 20}
    assert sched.schedule_urgent(plan) is None  # nothing waits
    sched.add_request(req("m", max_tokens=20, priority=5))
    sched.add_request(req("h", max_tokens=20, priority=0))
    urgent = sched.schedule_urgent(plan)
    assert urgent.num_scheduled_tokens == {"h": 4} and not urgent.preempted_req_ids
    assert [n.req_id for n in urgent.scheduled_new_reqs] == ["h"]
    sched.update(urgent, fake_run(worker.apply(urgent)))
    assert sched.requests["h"].output_token_ids == [7]
    assert sched.schedule_urgent(plan) is None  # m does not outrank the step
    sched.update(plan, fake_run(scheduled))
    assert [r.req_id for r in sched.running] == ["l1", "l2", "h"]
    plan, scheduled = worker.step()
    assert plan.preempted_req_ids == ["l2"] and plan.num_scheduled_tokens == {"h": 1, "l1": 1}
    assert sched.requests["l2"].status is RequestStatus.PREEMPTED and "l2" in sched.paused


def test_urgent_plans_need_the_priority_policy_and_a_request_outranking_the_whole_step():
    # Under fcfs never; under priority only a request more urgent than every one in the step (h2 is not more
    # urgent than h1, which the step computes).
    for policy in ("fcfs", "priority"):
        sched = make_scheduler(policy, max_num_seqs=4)
        sched.add_request(req("l", prompt_len=20, priority=5))
        sched.add_request(req("h1", prompt_len=20, priority=1))
        plan, _ = WorkerMirror(sched).schedule()
        assert set(plan.num_scheduled_tokens) == ({"l", "h1"} if policy == "fcfs" else {"h1"})
        sched.add_request(req("h2", priority=1))
        assert sched.schedule_urgent(plan) is None
        sched.add_request(req("h0", priority=0))
        urgent = sched.schedule_urgent(plan)
        assert (urgent is None) == (policy == "fcfs")
        if urgent is not None:
            assert list(urgent.num_scheduled_tokens) == ["h0"]
