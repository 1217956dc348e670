"""Speculative steps at the scheduler / KV-manager level (torch-free): drafts get lookahead slots, rejected
positions roll back, unverified tokens never reach the prefix cache, and every block returns to the pool."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput, SpecDecodeOutput
from pagedserve.sampling_params import SamplingParams
from tests.core.test_scheduler import check_invariants


def make_scheduler(num_blocks, block_size, budget=64, caching=True, max_seqs=8, mode="recompute", host=0):
    kv = KVCacheManager(num_blocks, block_size, caching, num_host_blocks=host)
    return Scheduler(SchedulerConfig(max_seqs, budget), kv, 10_000, preemption_mode=mode)


def request(req_id, prompt, max_tokens, stop_token_ids=None, min_tokens=0):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            stop_token_ids=stop_token_ids, min_tokens=min_tokens)
    return Request(req_id, list(prompt), params, max_tokens, eos_token_ids=(2,))


def fake_verify(sched, plan, rng, accept_prob):
    """What a runner would return: for each request reaching its last (draft) token, a random number of
    accepted drafts and one more token."""
    ids, tokens, accepted, num_drafts = [], [], [], []
    for req_id, n in plan.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        drafts = plan.scheduled_spec_decode_tokens.get(req_id, [])
        assert drafts == req.spec_token_ids
        if req.num_computed_tokens + n != req.num_tokens + len(drafts):
            assert not drafts  # drafts only ride on the step that samples
            continue
        a = 0
        while a < len(drafts) and rng.random() < accept_prob:
            a += 1
        ids.append(req_id)
        tokens.append(rng.randint(3, 6))
        accepted.append(drafts[:a])
        num_drafts.append(len(drafts))
    return ModelRunnerOutput(ids, tokens, spec=SpecDecodeOutput(accepted, num_drafts))


def check_cache_holds_verified_tokens(sched):
    kv = sched.kv
    for req_id, blocks in kv.req_blocks.items():
        req = sched.requests[req_id]
        assert req.num_computed_tokens <= req.num_tokens
        num_verified_blocks = req.num_computed_tokens // kv.block_size
        expected = kv._block_hashes(req, num_verified_blocks)
        for i, block in enumerate(blocks):
            if i >= num_verified_blocks:
                assert block.block_hash is None, (req_id, i)   # holds unverified (or no) tokens
            elif block.block_hash is not None:
                assert block.block_hash == expected[i]


def drive(sched, rng, reqs, accept_prob, abort_prob=0.05, k=4):
    pending = list(reqs)
    num_steps = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add_request(pending.pop())
        if sched.requests and rng.random() < abort_prob:
            sched.finish_request(rng.choice(list(sched.requests)), RequestStatus.FINISHED_ABORTED)
        plan = sched.schedule()
        assert plan.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        for req_id, drafts in plan.scheduled_spec_decode_tokens.items():
            req = sched.requests[req_id]
            # Lookahead slots: the table covers every scheduled draft.
            assert len(sched.kv.req_blocks[req_id]) * sched.kv.block_size >= req.num_tokens + len(drafts)
        result = fake_verify(sched, plan, rng, accept_prob)
        for req in sched.update(plan, result):
            if req.status is RequestStatus.RUNNING and rng.random() < 0.8:
                # Drafts from a small alphabet, so some match and prefix hits happen.
                req.spec_token_ids = [rng.randint(3, 6) for _ in range(rng.randint(1, k))]
        check_invariants(sched)
        check_cache_holds_verified_tokens(sched)
        num_steps += 1
        assert num_steps < 20_000
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    assert not sched.kv.req_blocks


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(2, 48), caching=st.booleans(), swap=st.booleans())
def test_random_speculative_steps_return_every_block(seed, num_blocks, block_size, budget, caching, swap):
    # 10 examples x 100 requests: 1,000 random requests with random acceptance.
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks, block_size, budget, caching, max_seqs=rng.randint(1, 6),
                           mode="swap" if swap else "recompute", host=num_blocks if swap else 0)
    cap = num_blocks * block_size
    reqs = []
    for i in range(100):
        max_tokens = rng.randint(1, max(1, cap // 3))
        prompt = [rng.randint(3, 6) for _ in range(rng.randint(1, max(1, min(40, cap - max_tokens))))]
        stop = [rng.randint(3, 6)] if rng.random() < 0.2 else None
        reqs.append(request(str(i), prompt, max_tokens, stop, min_tokens=rng.randint(0, min(3, max_tokens))))
    drive(sched, rng, reqs, accept_prob=rng.random())


def test_rejected_drafts_roll_back_and_their_slots_are_reused():
    sched = make_scheduler(num_blocks=8, block_size=4)
    req = request("a", [3, 4, 5, 6, 3], max_tokens=10)
    sched.add_request(req)
    plan = sched.schedule()
    sched.update(plan, ModelRunnerOutput(["a"], [4]))
    assert (req.num_tokens, req.num_computed_tokens) == (6, 5)
    req.spec_token_ids = [5, 6, 3, 4]
    plan = sched.schedule()
    # 1 + 4 query tokens at positions 5..9: blocks for 10 tokens (lookahead slots in block 2).
    assert plan.num_scheduled_tokens == {"a": 5} and plan.scheduled_spec_decode_tokens == {"a": [5, 6, 3, 4]}
    assert sched.kv.block_ids("a") == [0, 1, 2]
    sched.update(plan, ModelRunnerOutput(["a"], [9], spec=SpecDecodeOutput([[5, 6]], [4])))
    # Emitted 5, 6 (accepted) and 9 (recovered); K/V is valid up to d2, position 7.
    assert req.output_token_ids == [4, 5, 6, 9] and req.num_computed_tokens == 8 and req.num_tokens == 9
    # Block 1 (positions 4..7) holds verified tokens only and is cached; block 2 is not.
    blocks = sched.kv.req_blocks["a"]
    assert blocks[1].block_hash is not None and blocks[2].block_hash is None
    # The next step writes position 8 (the recovered token) into block 2: the rejected slots are reused.
    req.spec_token_ids = [3]
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"a": 2} and sched.kv.block_ids("a") == [0, 1, 2]
    assert plan.scheduled_cached_reqs.new_token_ids == [[5, 6, 9]]


def test_drafts_are_cut_at_max_tokens_and_at_a_stop_token():
    sched = make_scheduler(num_blocks=8, block_size=4)
    req = request("a", [3, 4, 5], max_tokens=4, stop_token_ids=[6])
    sched.add_request(req)
    sched.update(sched.schedule(), ModelRunnerOutput(["a"], [4]))
    req.spec_token_ids = [5, 5, 5, 5, 5]
    plan = sched.schedule()
    # 3 more tokens allowed: at most 2 drafts plus the sampled one.
    assert plan.scheduled_spec_decode_tokens == {"a": [5, 5]}
    sched.update(plan, ModelRunnerOutput(["a"], [3], spec=SpecDecodeOutput([[5, 5]], [2])))
    assert req.status is RequestStatus.FINISHED_LENGTH and req.output_token_ids == [4, 5, 5, 3]

    req = request("b", [3, 4, 5], max_tokens=10, stop_token_ids=[6])
    sched.add_request(req)
    sched.update(sched.schedule(), ModelRunnerOutput(["b"], [4]))
    req.spec_token_ids = [5, 6, 5]
    plan = sched.schedule()
    sched.update(plan, ModelRunnerOutput(["b"], [3], spec=SpecDecodeOutput([[5, 6, 5]], [3])))
    # The stop token 6 ends it: the tokens accepted after it are dropped.
    assert req.status is RequestStatus.FINISHED_STOPPED and req.output_token_ids == [4, 5, 6]
    assert sched.kv.pool.num_free_blocks == 8


def test_drafts_are_dropped_before_anyone_is_preempted():
    sched = make_scheduler(num_blocks=3, block_size=4)
    a = request("a", [3, 4, 5, 6, 3, 4, 5], max_tokens=4)
    b = request("b", [3, 4], max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    sched.update(sched.schedule(), ModelRunnerOutput(["a", "b"], [4, 4]))
    assert sched.kv.pool.num_free_blocks == 0
    # a's 2 drafts would need a fourth block (positions 7..9); without them it writes position 7 only.
    a.spec_token_ids = [5, 6]
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1} and not plan.scheduled_spec_decode_tokens
    assert not plan.preempted_req_ids and a.spec_token_ids == []
