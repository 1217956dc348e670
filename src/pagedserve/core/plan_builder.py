"""One step's plan, and what the worker already holds of each request (plans carry only differences).

A request's first plan sends it whole (NewRequestData); later plans send only the tokens appended and the
blocks allocated since (CachedRequestData), as vLLM V1 does.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.request import Request
from pagedserve.core.scheduler_output import CachedRequestData, NewRequestData


@dataclass(slots=True)
class _WorkerView:
    # How much of a request the worker holds: its first num_tokens tokens and first num_blocks block ids
    # (0 after a preemption, when the worker drops the table: the next plan sends it whole).
    num_tokens: int
    num_blocks: int


class PlanBuilder:
    # Collects one step's plan; each scheduled request is added once, in batch order.
    def __init__(self) -> None:
        self.new_reqs: list[NewRequestData] = []
        self.cached = CachedRequestData()
        self.num_scheduled_tokens: dict[str, int] = {}
        self.num_prompt_tokens = 0
        self.num_sampling_reqs = 0
        self.spec_tokens: dict[str, list[int]] = {}


class WorkerViews:
    """Requests the worker holds state for: scheduled at least once, not yet reported finished."""

    def __init__(self) -> None:
        self._views: dict[str, _WorkerView] = {}

    def resumed(self, req_id: str) -> None:
        # Back from preemption: the worker dropped the block table, so the next plan sends it whole.
        self._views[req_id].num_blocks = 0

    def drop(self, req_id: str) -> bool:
        """Forget the request; True if the worker held it (its id must then reach the worker as finished)."""
        return self._views.pop(req_id, None) is not None

    def add(self, plan: PlanBuilder, req: Request, num_new: int, block_ids: list[int]) -> None:
        start = req.num_computed_tokens
        plan.num_scheduled_tokens[req.req_id] = num_new
        plan.num_prompt_tokens += max(0, min(req.num_prompt_tokens, start + num_new) - start)
        # Scheduled drafts sit after the last token: the step samples when it reaches num_tokens + drafts.
        num_drafts = len(req.spec_token_ids)
        if num_drafts and start + num_new == req.num_tokens + num_drafts:
            plan.spec_tokens[req.req_id] = list(req.spec_token_ids)
        else:
            num_drafts = 0
        plan.num_sampling_reqs += start + num_new - num_drafts == req.num_tokens
        view = self._views.get(req.req_id)
        if view is None:
            plan.new_reqs.append(NewRequestData(req.req_id, req.prompt_token_ids, req.params, req.eos_token_ids,
                                                list(block_ids), start))
            self._views[req.req_id] = _WorkerView(req.num_tokens, len(block_ids))
            return
        # A table known to the worker only grows at its end: copy-on-write replaces a block only in a table
        # the worker has not seen yet (a fork's first plan). tests/core check this against a mirror.
        c = plan.cached
        c.req_ids.append(req.req_id)
        c.resumed_from_preemption.append(view.num_blocks == 0)
        c.new_token_ids.append(req.all_token_ids[view.num_tokens:])
        c.new_block_ids.append(block_ids[view.num_blocks:])
        c.num_computed_tokens.append(start)
        view.num_tokens, view.num_blocks = req.num_tokens, len(block_ids)
