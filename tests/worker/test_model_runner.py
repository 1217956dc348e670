"""The runner's step tensors, built from its own input batch, equal a plain per-request reference computed from
the scheduler's requests, through chunked prefill, forks, preemption and swaps; sampled tokens map back."""
from __future__ import annotations

import random

import torch

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.kv_cache import allocate_host_caches, allocate_kv_caches
from pagedserve.worker.model_runner import ModelRunner

VOCAB = 64
BLOCK = 4


class NextTokenModel(torch.nn.Module):
    # Greedy sampling picks (last input token + 1) % VOCAB; each forward's inputs and the number of rows given
    # to the LM head are kept for checking.
    def __init__(self) -> None:
        super().__init__()
        self.calls = []
        self.logit_rows = []

    def forward(self, input_ids, positions, kv_caches, meta):
        self.calls.append((input_ids.tolist(), positions.tolist(), meta))
        return input_ids.to(torch.float32).unsqueeze(1)

    def compute_logits(self, hidden):
        self.logit_rows.append(hidden.shape[0])
        return torch.nn.functional.one_hot((hidden[:, 0].long() + 1) % VOCAB, VOCAB).to(torch.float32)


def reference(sched: Scheduler, plan):
    # What the step must feed the model, straight from the scheduler's requests.
    ids, positions, slots, seq_lens, tables = [], [], [], [], []
    for req_id, n in plan.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        start = req.num_computed_tokens
        blocks = sched.kv.block_ids(req_id)
        ids += req.all_token_ids[start:start + n]
        positions += list(range(start, start + n))
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
        seq_lens.append(start + n)
        tables.append(blocks)
    return ids, positions, slots, seq_lens, tables


def test_step_inputs_follow_the_scheduler():
    rng = random.Random(5)
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_caching=True, num_host_blocks=6)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12), kv, 200, preemption_mode="swap")
    model = NextTokenModel()
    runner = ModelRunner(model, allocate_kv_caches(1, 16, BLOCK, 1, 2, torch.float32, "cpu"), BLOCK, VOCAB,
                         torch.device("cpu"), max_num_reqs=4, max_model_len=200)
    runner.host_caches = allocate_host_caches(1, 6, BLOCK, 1, 2, torch.float32, torch.device("cpu"))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    pending = []
    for i in range(30):
        first = Request(f"{i}.0", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))], greedy, rng.randint(1, 12))
        pending += [(first, None)] + [(Request(f"{i}.{k}", first.prompt_token_ids, greedy, first.max_tokens), first)
                                      for k in range(1, rng.choice([1, 2]))]
    requests = [r for r, _ in pending]
    num_steps = skipped_rows = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add_request(*pending.pop(0))
        if sched.requests and rng.random() < 0.05:
            sched.finish_request(rng.choice(list(sched.requests)), RequestStatus.FINISHED_ABORTED)
        plan = sched.schedule()
        want = reference(sched, plan)
        model.calls.clear()
        model.logit_rows.clear()
        result = runner.execute(plan)
        if plan.num_scheduled_tokens:
            [(ids, positions, meta)] = model.calls
            got_tables = [row[:len(t)] for row, t in zip(meta.block_tables.tolist(), want[4])]
            assert (ids, positions, meta.slot_mapping.tolist(), meta.seq_lens_list, got_tables) == want
            assert meta.query_lens_list == list(plan.num_scheduled_tokens.values())
            # The LM head sees one row per sampled request (its last token), never the other prompt rows of a
            # prefill nor a chunk that stops short of its prompt's end (a real model's head is the largest GEMM).
            assert sum(model.logit_rows) == len(result.req_ids)
            skipped_rows += len(ids) - len(result.req_ids)
            num_steps += 1
        for req_id, token in zip(result.req_ids, result.sampled_token_ids):
            req = sched.requests[req_id]
            assert token == (req.all_token_ids[-1] + 1) % VOCAB
        sched.update(plan, result)
    runner.execute(sched.schedule())
    assert not runner.input_batch.requests
    assert num_steps > 30 and kv.num_swapped_out_blocks > 0 and kv.num_cow_copies > 0 and skipped_rows > 100
    # Every request that finished by length holds the runner's greedy chain.
    for req in requests:
        if req.status is RequestStatus.FINISHED_LENGTH:
            chain = [(req.prompt_token_ids[-1] + k) % VOCAB for k in range(1, req.num_output_tokens + 1)]
            assert req.output_token_ids == chain
