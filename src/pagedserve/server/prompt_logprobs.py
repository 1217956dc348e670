"""vLLM's `prompt_logprobs` response field, shared by the completion and chat endpoints."""
from __future__ import annotations

from pagedserve.outputs import PromptLogprobs
from pagedserve.server.protocol import PromptLogprob, PromptLogprobsField


def prompt_logprobs_field(token_ids: list[int], entries: PromptLogprobs | None,
                          num_top: int) -> PromptLogprobsField | None:
    # The engine may have scored more alternatives than asked here (echo with a larger logprobs shares the
    # same computation), so keep the prompt token plus ranks 1..num_top, as a request for num_top alone gets.
    if entries is None:
        return None
    out: PromptLogprobsField = [None]
    for token_id, entry in zip(token_ids[1:], entries[1:]):
        out.append({t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
                    for t, lp in (entry or {}).items()
                    if t == token_id or (lp.rank is not None and lp.rank <= num_top)})
    return out
