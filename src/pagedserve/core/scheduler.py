"""Continuous batching: every step, running requests first, then waiting ones, under a token budget.

Each scheduled request catches its num_computed_tokens up towards num_tokens by at most the remaining
budget (chunked prefill). When the pool is short the newest running request is preempted by recompute:
its blocks are freed, its tokens kept, and it goes back to the front of the waiting queue.
"""
from __future__ import annotations

from collections import deque

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler_output import (ModelRunnerOutput, ScheduledRequest, SchedulerOutput,
                                              SchedulerStats)
from pagedserve.engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self._finished_since_plan: list[str] = []

    @property
    def capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def add_request(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        need = req.num_prompt_tokens + req.max_tokens
        if need > self.capacity_tokens:
            raise ValueError(f"prompt ({req.num_prompt_tokens} tokens) plus max_tokens ({req.max_tokens}) "
                             f"can never fit in the KV cache ({self.capacity_tokens} tokens)")
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while (new_ids := self.kv.allocate_slots(req, num_new)) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is req:
                    break
            if new_ids is None:
                break
            scheduled.append(self._plan(req, num_new))
            budget -= num_new
            i += 1

        # Admit waiting requests only when nothing was preempted: memory is short this step.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            self.kv.record_prefix_query(req, num_hit_tokens)
            self.waiting.popleft()
            req.num_computed_tokens = num_hit_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._plan(req, num_new))
            budget -= num_new

        finished, self._finished_since_plan = self._finished_since_plan, []
        return SchedulerOutput(scheduled, self.config.max_num_batched_tokens - budget, preempted, finished)

    def _plan(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(req, req.all_token_ids[start:start + num_new], start,
                                self.kv.block_ids(req.req_id), start + num_new == req.num_tokens)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req, finished=False)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests. Returns requests with a new token."""
        sampled = dict(zip(result.req_ids, range(len(result.req_ids))))
        updated: list[Request] = []
        for s in plan.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += len(s.token_ids)
            self.kv.cache_blocks(req)
            if not s.sample:
                continue
            j = sampled[req.req_id]
            req.append_token(result.sampled_token_ids[j])
            if result.logprobs is not None:
                req.cumulative_logprob += result.logprobs[j]
            status = req.check_stop(self.max_model_len)
            if status is not None:
                self.finish_request(req.req_id, status)
            updated.append(req)
        return updated

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self._finished_since_plan.append(req_id)
        return req

    def stats(self) -> SchedulerStats:
        ps = self.kv.prefix_stats
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage(),
                              self.num_preemptions_total, ps.num_queries, ps.num_hits,
                              self.kv.pool.num_free_blocks, self.kv.num_blocks)
