"""Greedy outputs must not depend on paging, batching, chunking, preemption or prefix caching."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.messages import Arrivals

PROMPTS = [
    "The quick brown fox",
    "Write a haiku about the ocean:",
    "List three uses of paper clips: 1.",
    "def add(a, b):\n    return",
    "The history of the Roman Empire begins with",
    "Water is made of",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("kwargs", [
    dict(num_gpu_blocks_override=12, block_size=4),                        # forces preemption
    dict(max_num_batched_tokens=7, block_size=4),                          # tiny chunks across blocks
    dict(max_num_seqs=1, enable_prefix_caching=False),                     # no batching
    dict(block_size=1, enable_chunked_prefill=False),
])
def test_greedy_is_invariant(reference, kwargs):
    llm = LLM(kv_cache_memory_bytes=16 << 20, **kwargs)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    engine = llm.llm_engine
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks
    if "num_gpu_blocks_override" in kwargs:
        assert engine.scheduler.num_preemptions_total > 0


def test_priority_policy_serves_urgent_first_and_keeps_greedy_outputs(reference):
    # Two at a time in a small pool: the most urgent prompts (lowest priority value) start first, preempting
    # less urgent ones where the pool runs short; every answer stays the one computed alone.
    llm = LLM(kv_cache_memory_bytes=16 << 20, num_gpu_blocks_override=12, block_size=4, max_num_seqs=2,
              scheduling_policy="priority")
    priorities = [3, 2, 1, 0, -1, -2]
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=priorities)
    assert [o.outputs[0].token_ids for o in outs] == reference
    scheduled = [o.metrics.scheduled_time for o in outs]
    assert sorted(range(len(PROMPTS)), key=scheduled.__getitem__) == [5, 4, 3, 2, 1, 0]
    engine = llm.llm_engine
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks
    with pytest.raises(ValueError, match="got 6 prompts but 2 priorities"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 1])


def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate("hi", PARAMS, use_tqdm=False, priority=[1])


def test_an_urgent_request_runs_between_the_layers_of_a_long_step(reference):
    # Three prompts at priority 5 fill the batch (max_num_seqs=3) and prefill in one step; an urgent prompt
    # (priority 0) arrives at that step's first layer boundary (the asyncio front-end's Arrivals and flag, played
    # here) and runs its own step right there: its first token is out before the long step ends. The next step pauses
    # the least urgent to bring the batch back to 3. Every answer stays the one computed alone.
    llm = LLM(kv_cache_memory_bytes=16 << 20, scheduling_policy="priority", max_num_seqs=3)
    engine = llm.llm_engine
    outputs, asked = {}, []

    def collect(request_outputs):
        outputs.update((o.request_id, o) for o in request_outputs)

    def take():  # between two layers of a step, once the flag is set
        pending[0] = 0
        asked.append(engine.scheduler.waiting.now)
        engine.add_request("urgent", PROMPTS[3], PARAMS, priority=0)

    pending = bytearray(8)
    engine.core.arrivals = Arrivals(take, lambda outs: collect(engine.output_processor.process_outputs(outs)
                                                               .request_outputs), pending)
    for i in range(3):
        engine.add_request(f"low{i}", PROMPTS[i], PARAMS, priority=5)
    pending[0] = 1  # the front-end queued a request: the step stops at its first layer boundary
    first = engine.step()
    assert len(outputs["urgent"].outputs[0].token_ids) == 1  # emitted inside the step
    assert sorted(o.request_id for o in first) == ["low0", "low1", "low2"]
    assert asked == [1]  # once, in the first step
    collect(first)
    while engine.has_unfinished_requests():
        collect(engine.step())
    assert engine.scheduler.num_preemptions_total >= 1  # the pause back to max_num_seqs
    assert [outputs[r].outputs[0].token_ids for r in ("low0", "low1", "low2", "urgent")] == reference[:4]
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks
