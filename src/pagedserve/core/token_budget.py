"""How many tokens one step may compute: adaptive between --min- and --max-num-batched-tokens.

A step's time grows with its tokens, and every decoding request waits for the whole step. While few requests
decode, a large step costs little TPOT and prefills a burst of prompts in fewer steps (the TTFT tail); while
many decode, a small step keeps their TPOT. What counts is how many decoding requests there are per prompt
waiting for its first token (P: running prefills, plus waiting requests the batch has room for, at least 1):
the prefill part of the budget is the maximum divided by (1 + decoding requests / (DECODES_PER_HALVING * P)),
never below the floor, and every decode token comes on top. One prompt joining (P = 1):

    decoding requests   0      1      2      4      8      16
    prefill budget      2048   1638   1365   1024   682    512 (floor)    (defaults: 512..2048)

A burst keeps the big budget while its own first requests start decoding: 16 prompts of 300 tokens all have
their first token after 3 steps (2048, 1786, 984 tokens) instead of 6 when P is not counted
(tests/core/test_token_budget.py), which is what a fixed 2048 gives. The total never exceeds the maximum, and
min == max gives a fixed budget.

Long prefills (LONG_PREFILL_TOKEN_THRESHOLD): a prompt first gets at most the threshold, so short prompts
behind a long one start in the same step; what the step has left over goes back to the long ones
(Scheduler._top_up), so a prompt alone still gets the whole budget.
"""
from __future__ import annotations

from pagedserve.config import SchedulerConfig
from pagedserve.core.request import Request

DECODES_PER_HALVING = 4


def step_budget(config: SchedulerConfig, running: list[Request], num_admissible: int = 0) -> int:
    """num_admissible: waiting requests the batch has room for (each waits for its first token)."""
    most = config.max_num_batched_tokens
    floor = config.min_num_batched_tokens or most
    if floor >= most:
        return most
    num_decoding = num_decode_tokens = 0
    num_prefilling = num_admissible
    for req in running:
        if req.num_tokens - req.num_computed_tokens == 1:
            num_decoding += 1
            num_decode_tokens += 1 + len(req.spec_token_ids)
        else:
            num_prefilling += 1
    # Decoding requests per prompt waiting for its first token: a burst of prompts keeps a big budget while
    # its own first requests start decoding; one prompt joining a full batch gets the small one.
    p = max(1, num_prefilling) * DECODES_PER_HALVING
    prefill = max(floor, most * p // (p + num_decoding))
    return min(most, prefill + num_decode_tokens)
