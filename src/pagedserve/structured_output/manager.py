"""Per-sequence grammar matchers on the engine thread: token bitmask before sampling, accept after.

    runner:  logits [N, V] --apply_bitmask(req_ids)--> disallowed tokens -inf --> sampler
    core:    sampled token --accept_token--> matcher advances; terminated (stop token accepted) -> "stop"

Only rows with a matcher are masked; the others cost nothing. Per step: one preallocated int32 bitmask
[max_num_seqs, ceil(V / 32)], each constrained row filled by its matcher in C++, then one call of xgrammar's CPU
kernel over the listed rows. No Python loop touches the vocabulary. Measured (benchmarks/HISTORY.md): fill +
apply + accept are about 0.6% of a 16-sequence decode step's engine-thread CPU time.
rollback / validate_tokens are the hooks for speculative decoding: draft tokens are checked against the grammar
and rejected ones are undone.
"""
from __future__ import annotations

from typing import Any

import torch


class StructuredOutputManager:
    def __init__(self, vocab_size: int, max_num_rows: int = 8) -> None:
        self.vocab_size = vocab_size
        self.matchers: dict[str, Any] = {}
        self._max_num_rows = max_num_rows
        self._bitmask: torch.Tensor | None = None  # int32 [rows, ceil(V / 32)], made with the first matcher

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.matchers

    def add_request(self, req_id: str, grammar: Any) -> None:
        import xgrammar as xgr

        self.matchers[req_id] = xgr.GrammarMatcher(grammar)
        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(self._max_num_rows, self.vocab_size)

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)

    def apply_bitmask(self, logits: torch.Tensor, req_ids: list[str]) -> None:
        """Masks, in place, row i of logits with the grammar of req_ids[i] (rows without one are untouched)."""
        if not self.matchers:
            return
        import xgrammar as xgr

        if self._bitmask.shape[0] < len(req_ids):  # more rows than max_num_seqs: speculative rows
            self._bitmask = xgr.allocate_token_bitmask(len(req_ids), self.vocab_size)
        bitmask = self._bitmask
        indices = []
        for i, req_id in enumerate(req_ids):
            matcher = self.matchers.get(req_id)
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, i)
                indices.append(i)
        if not indices:
            return
        if bitmask.device != logits.device:
            bitmask = bitmask[:len(req_ids)].to(logits.device, non_blocking=True)
        # xgrammar's CPU kernel (or its Triton one on GPU) masks only the listed rows, in place.
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=indices)

    def accept_token(self, req_id: str, token_id: int) -> bool:
        matcher = self.matchers.get(req_id)
        return True if matcher is None else bool(matcher.accept_token(token_id))

    def is_terminated(self, req_id: str) -> bool:
        matcher = self.matchers.get(req_id)
        return matcher is not None and matcher.is_terminated()

    def validate_tokens(self, req_id: str, token_ids: list[int]) -> int:
        """How many leading draft tokens the grammar accepts; the matcher is left where it was."""
        matcher = self.matchers.get(req_id)
        if matcher is None:
            return len(token_ids)
        num_ok = 0
        for t in token_ids:
            if matcher.is_terminated() or not matcher.accept_token(t):
                break
            num_ok += 1
        if num_ok:
            matcher.rollback(num_ok)
        return num_ok

    def rollback(self, req_id: str, num_tokens: int) -> None:
        # Undo the last num_tokens accepted tokens (rejected speculative tokens).
        matcher = self.matchers.get(req_id)
        if matcher is not None and num_tokens > 0:
            matcher.rollback(num_tokens)

