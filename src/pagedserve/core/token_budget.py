"""How many tokens one step may compute: adaptive between --min- and --max-num-batched-tokens.

A step's time grows with its tokens, and every decoding request waits for the whole step. While few requests
decode, a large step costs little TPOT and prefills a burst of prompts in fewer steps (the TTFT tail); while
many decode, a small step keeps their TPOT. So the prefill part of the budget is the maximum divided by
(1 + decoding requests / DECODES_PER_HALVING), never below the floor, and every decode token comes on top:

    decoding requests   0      1      2      4      8      16
    prefill budget      2048   1638   1365   1024   682    512 (floor)    (defaults: 512..2048)

The total never exceeds the maximum, and min == max gives today's fixed budget.

Long prefills (LONG_PREFILL_TOKEN_THRESHOLD): a prompt first gets at most the threshold, so short prompts
behind a long one start in the same step; what the step has left over goes back to the long ones
(Scheduler._top_up), so a prompt alone still gets the whole budget.
"""
from __future__ import annotations

from pagedserve.config import SchedulerConfig
from pagedserve.core.request import Request

DECODES_PER_HALVING = 4


def step_budget(config: SchedulerConfig, running: list[Request]) -> int:
    most = config.max_num_batched_tokens
    floor = config.min_num_batched_tokens or most
    if floor >= most:
        return most
    num_decoding = num_decode_tokens = 0
    for req in running:
        if req.num_tokens - req.num_computed_tokens == 1:
            num_decoding += 1
            num_decode_tokens += 1 + len(req.spec_token_ids)
    prefill = max(floor, most * DECODES_PER_HALVING // (DECODES_PER_HALVING + num_decoding))
    return min(most, prefill + num_decode_tokens)
