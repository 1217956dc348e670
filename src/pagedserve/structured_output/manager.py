"""Per-sequence grammar matchers beside the scheduler: the step's token bitmask before it runs, accept after.

    engine core:  plan --with_bitmask--> the plan with GrammarOutput(req_ids, int32 bitmask) of its sampling rows
    worker:       logits [N, V] --sample/grammar_bitmask.py--> disallowed tokens -inf --> sampler
    engine core:  sampled token --accept_token--> matcher advances; terminated (stop token accepted) -> "stop"

Only requests with a matcher get a row; the others cost nothing. Per step: one int32 bitmask
[rows, ceil(V / 32)], each row filled by its matcher in C++; the worker masks with xgrammar's CPU kernel. No
Python loop touches the vocabulary. Measured (benchmarks/HISTORY.md): fill + apply + accept are about 0.6% of
a 16-sequence decode step's engine-thread CPU time.
rollback / validate_tokens are the hooks for speculative decoding: draft tokens are checked against the grammar
and rejected ones are undone.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve.core.request import Request
from pagedserve.core.scheduler_output import GrammarOutput, SchedulerOutput


class StructuredOutputManager:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.matchers: dict[str, Any] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.matchers

    def add_request(self, req_id: str, grammar: Any) -> None:
        import xgrammar as xgr

        self.matchers[req_id] = xgr.GrammarMatcher(grammar)

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)

    def with_bitmask(self, plan: SchedulerOutput, requests: dict[str, Request]) -> SchedulerOutput:
        """plan with the bitmask of its requests under a grammar that sample this step (their scheduled tokens
        reach their last one: a prefill chunk short of the end needs none); plan itself when there is none."""
        if not self.matchers:
            return plan
        sampling = [r for r, n in plan.num_scheduled_tokens.items()
                    if r in self.matchers and requests[r].num_computed_tokens + n >= requests[r].num_tokens]
        grammar = self.grammar_output(sampling)
        return plan if grammar is None else dataclasses.replace(plan, grammar=grammar)

    def grammar_output(self, req_ids: list[str]) -> GrammarOutput | None:
        """The allowed next tokens of each of req_ids that has a running matcher; None when none has."""
        rows = [(r, m) for r in req_ids if (m := self.matchers.get(r)) is not None and not m.is_terminated()]
        if not rows:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)  # fresh: the plan keeps it
        for i, (_, matcher) in enumerate(rows):
            matcher.fill_next_token_bitmask(bitmask, i)
        return GrammarOutput([r for r, _ in rows], bitmask.numpy())

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

