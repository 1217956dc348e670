"""The worker's input batch, fed only the plans' differences, holds exactly the scheduler's tokens, block
tables and computed counts for every scheduled request, through forks, preemption, swaps and aborts."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.input_batch import InputBatch


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_batch(batch: InputBatch, sched: Scheduler, plan) -> list[str]:
    sampled = []
    for req_id, n in plan.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        row = batch.row_of(req_id)
        assert batch.token_ids[row, :batch.num_tokens[row]].tolist() == req.all_token_ids
        assert batch.block_table[row, :batch.num_blocks[row]].tolist() == sched.kv.block_ids(req_id)
        assert batch.num_computed_tokens[row] == req.num_computed_tokens
        state = batch.requests[req_id]
        assert state.output_token_ids == req.output_token_ids and state.prompt_token_ids == req.prompt_token_ids
        assert (state.generator is None) == (req.params.seed is None)
        if batch.num_computed_tokens[row] + n == batch.num_tokens[row]:
            sampled.append(req_id)
    rows = [s.row for s in batch.requests.values() if s.row is not None]
    assert len(rows) == len(set(rows)) and not set(rows) & set(batch.free_rows)
    for req_id in plan.preempted_req_ids:
        assert batch.requests[req_id].row is None
    for req_id in plan.finished_req_ids:
        assert req_id not in batch.requests
    return sampled


@pytest.mark.parametrize("mode, max_num_reqs, max_model_len", [("recompute", 6, 64), ("swap", 6, 64),
                                                                ("swap", 1, 4)])   # the last grows the arrays
def test_batch_follows_the_scheduler(mode, max_num_reqs, max_model_len):
    rng = random.Random(3)
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_caching=True, num_host_blocks=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16), kv, 1000, preemption_mode=mode)
    batch = InputBatch(max_num_reqs, max_model_len, block_size=4)
    pending = []
    for i in range(120):
        params = SamplingParams(max_tokens=30, temperature=1.0, seed=rng.choice([None, i]), ignore_eos=True)
        first = Request(f"{i}.0", [3 + (i * 7 + k) % 50 for k in range(rng.randint(1, 24))], params,
                        rng.randint(1, 20))
        pending.append((first, None))
        for k in range(1, rng.choice([1, 1, 3])):
            pending.append((Request(f"{i}.{k}", first.prompt_token_ids, params, first.max_tokens), first))
    generators = {}
    num_preempted = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 4)):
            if pending:
                sched.add_request(*pending.pop(0))
        if sched.requests and rng.random() < 0.05:
            sched.finish_request(rng.choice(list(sched.requests)), RequestStatus.FINISHED_ABORTED)
        plan = sched.schedule()
        batch.apply(plan, make_generator)
        for req_id, state in batch.requests.items():
            # A seeded request keeps one generator for its lifetime, through preemption.
            assert generators.setdefault(req_id, state.generator) is state.generator
        num_preempted += len(plan.preempted_req_ids)
        sampled = check_batch(batch, sched, plan)
        sched.update(plan, ModelRunnerOutput(sampled, [rng.randint(3, 60) for _ in sampled]))
    batch.apply(sched.schedule(), make_generator)
    assert not batch.requests and sorted(batch.free_rows) == list(range(len(batch.num_tokens)))
    assert num_preempted > 0
