"""N-gram prompt lookup (vLLM's "ngram" method): drafts copied from the request's own tokens.

If the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) occurred earlier, the
tokens that followed that occurrence are the draft. Answers that quote the prompt (a table row, a tool's
output, code being edited) get long drafts for free; elsewhere there is usually no match and no draft.
Torch-free: it reads token ids only.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedserve.spec_decode.proposer import Proposer, SampledStep


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, step: SampledStep) -> dict[str, list[int]]:
        if not step.drafting:
            return {}
        return {req_id: self.lookup(step.tokens_after(j)) for j, req_id in enumerate(step.out.req_ids)
                if req_id not in step.undrafted}

    def lookup(self, token_ids: list[int] | np.ndarray, max_num_tokens: int | None = None) -> list[int]:
        k = self.k if max_num_tokens is None else min(self.k, max_num_tokens)
        tokens = np.asarray(token_ids, dtype=np.int64)
        size = len(tokens)
        if k < 1:
            return []
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # Windows that start early enough to have a continuation: tokens[i:i + n] with i + n < size.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                # The most recent occurrence: the text just before is the likeliest to go on the same way.
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
