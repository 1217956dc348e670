"""The runner masks logits with the bitmask its plan carries (structured outputs) and holds no grammar: a plan
whose bitmask allows one token gets that token, whichever the model prefers; rows without a bitmask row are
untouched."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import GrammarOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.kv_cache import allocate_kv_caches
from pagedserve.worker.model_runner import ModelRunner
from tests.worker.test_model_runner import BLOCK, VOCAB, NextTokenModel


def only(*token_ids: int) -> np.ndarray:
    # One bitmask row (xgrammar's layout: bit t % 32 of word t // 32) allowing just token_ids.
    row = np.zeros((VOCAB + 31) // 32, dtype=np.uint32)
    for t in token_ids:
        row[t // 32] |= np.uint32(1 << (t % 32))
    return row.view(np.int32)


def test_runner_applies_the_plans_bitmask_without_a_grammar():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, 64)
    runner = ModelRunner(NextTokenModel(), allocate_kv_caches(1, 16, BLOCK, 1, 2, torch.float32, "cpu"), BLOCK,
                         VOCAB, torch.device("cpu"), max_num_reqs=4, max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for req_id, prompt in (("a", [1, 2, 3]), ("b", [10, 11]), ("c", [20])):
        sched.add_request(Request(req_id, prompt, greedy, 4))
    # Unmasked, the model picks last token + 1: a -> 4, b -> 12, c -> 21.
    plan = sched.schedule()
    assert list(plan.num_scheduled_tokens) == ["a", "b", "c"] and plan.grammar is None
    # Rows in another order than the batch's; b has none.
    grammar = GrammarOutput(["c", "a"], np.stack([only(40), only(33, 63)]))
    result = runner.execute(dataclasses.replace(plan, grammar=grammar))
    assert dict(zip(result.req_ids, result.sampled_token_ids)) == {"a": 33, "b": 12, "c": 40}
    assert not hasattr(runner, "structured_output")
    sched.update(plan, result)
    # The next plan carries no bitmask: nothing is masked any more.
    plan = sched.schedule()
    result = runner.execute(plan)
    assert dict(zip(result.req_ids, result.sampled_token_ids)) == {"a": 34, "b": 13, "c": 41}
