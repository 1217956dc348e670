"""Prompt logprobs: the LM head over every prompt position a step computes, for the requests that ask.

The logits row at position p scores prompt token p + 1, so with chunked prefill the last row of a chunk scores
the first token of the next chunk, and the row at the last prompt position is the sampler's (it scores the
first output token):

    prompt       t0    t1    t2  | t3    t4    t5        chunked 3 | 3
    rows         p0    p1    p2  | p3    p4   (p5: sampled)
    scores       t1    t2    t3  | t4    t5
    entries    None    t1    t2    t3    t4    t5        (RequestOutput.prompt_logprobs)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.core.scheduler_output import PromptLogprobsChunk
from pagedserve.sample.sampler import compute_logprobs

# Rows per LM-head call: bounds the [rows, vocab] fp32 logits and log-softmax of a long prefill chunk
# (about 25 MiB each for 128 rows of a 49k vocabulary) instead of materializing 512 x vocab twice.
ROWS_PER_CALL = 128


@dataclass(frozen=True, slots=True)
class PromptSpan:
    req_id: str
    first_row: int          # row in the step's flat hidden states of the request's first position this step
    first_index: int        # prompt index of target_ids[0]
    target_ids: list[int]   # the prompt tokens scored by consecutive rows from first_row
    num_top: int


def prompt_span(req_id: str, prompt_token_ids: list[int], start: int, num_new: int, num_top: int,
                first_row: int) -> PromptSpan | None:
    """The rows of a step computing positions [start, start + num_new) that score prompt tokens, or None."""
    # Positions from start up to the one before the last prompt token: each scores its successor.
    # After a preemption the recomputed chunk covers output tokens too; those rows score nothing here.
    end = min(start + num_new, len(prompt_token_ids) - 1)
    if end <= start:
        return None
    return PromptSpan(req_id, first_row, start + 1, prompt_token_ids[start + 1:end + 1], num_top)


def compute_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor,
                            spans: list[PromptSpan]) -> dict[str, PromptLogprobsChunk]:
    device = hidden.device
    rows = torch.cat([torch.arange(sp.first_row, sp.first_row + len(sp.target_ids)) for sp in spans]).to(device)
    targets = torch.tensor([t for sp in spans for t in sp.target_ids], dtype=torch.long, device=device)
    num_top: list[int | None] = [sp.num_top for sp in spans for _ in sp.target_ids]
    logprobs: list[float] = []
    ranks: list[int] = []
    tops: list[list[tuple[int, float]]] = []
    for a in range(0, len(num_top), ROWS_PER_CALL):
        b = a + ROWS_PER_CALL
        # Raw model distribution (no temperature or penalties), as for sampled-token logprobs.
        lp = model.compute_logits(hidden[rows[a:b]]).to(torch.float32).log_softmax(dim=-1)
        chosen, rank, top = compute_logprobs(lp, targets[a:b], num_top[a:b])
        logprobs += chosen
        ranks += rank
        tops += top
    out: dict[str, PromptLogprobsChunk] = {}
    i = 0
    for sp in spans:
        j = i + len(sp.target_ids)
        out[sp.req_id] = PromptLogprobsChunk(sp.first_index, sp.target_ids, logprobs[i:j], ranks[i:j], tops[i:j])
        i = j
    return out
