"""Continuous batching: every step, running requests first, then waiting ones, under a token budget.

Each scheduled request catches its num_computed_tokens up towards num_tokens by at most the remaining
budget (chunked prefill). When the pool is short the newest running request is preempted: by recompute
(blocks freed, tokens kept, computed again later) or, with preemption_mode="swap" and room in the host
pool, by swapping its blocks out and back in. Either way it goes back to the front of the waiting queue.

Parallel samples of one prompt are forks: the first sample prefills the prompt; the others wait until it
has, then share its blocks (the last, partly filled one copy-on-write) and compute only the last token.

Plans describe requests to the worker by difference (vLLM V1): a request's first plan sends it whole
(NewRequestData), later plans send only the tokens appended and the blocks allocated since (CachedRequestData).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler_output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                              SchedulerOutput, SchedulerStats)


@dataclass(slots=True)
class _WorkerView:
    # How much of a request the worker holds: its first num_tokens tokens and first num_blocks block ids
    # (0 after a preemption, when the worker drops the table: the next plan sends it whole).
    num_tokens: int
    num_blocks: int


class _PlanBuilder:
    # Collects one step's plan; each scheduled request is added once, in batch order.
    def __init__(self) -> None:
        self.new_reqs: list[NewRequestData] = []
        self.cached = CachedRequestData()
        self.num_scheduled_tokens: dict[str, int] = {}
        self.num_prompt_tokens = 0
        self.num_sampling_reqs = 0
        self.spec_tokens: dict[str, list[int]] = {}


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 preemption_mode: str = "recompute") -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.num_preemptions_swap = 0
        # Forked samples waiting for their source's prefill, keyed by the source's req_id.
        self.pending_forks: dict[str, list[Request]] = {}
        self.fork_source: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self._finished_since_plan: list[str] = []
        # Requests the worker holds state for (scheduled at least once, not yet reported finished).
        self._worker_views: dict[str, _WorkerView] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        # A request that can never be scheduled must fail now, not wait at the head of the queue forever.
        need = num_prompt_tokens + max_tokens
        if need > self.capacity_tokens:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
                             f"can never fit in the KV cache ({self.capacity_tokens} tokens)")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and num_prompt_tokens > budget:
            # Unchunked, it would wait at the head of the queue forever and block every request behind it.
            raise ValueError(f"the prompt ({num_prompt_tokens} tokens) can never be scheduled: without chunked "
                             f"prefill it must fit one step's budget, max_num_batched_tokens={budget}")

    def add_request(self, req: Request, fork_of: Request | None = None) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.check_request(req.num_prompt_tokens, req.max_tokens)
        self.requests[req.req_id] = req
        if fork_of is not None and fork_of.req_id in self.requests and not fork_of.output_token_ids:
            self.pending_forks.setdefault(fork_of.req_id, []).append(req)
            self.fork_source[req.req_id] = fork_of
        else:
            self.waiting.append(req)

    def _release_forks(self, src: Request) -> None:
        # Forks join the queue right behind the front, so they are admitted while src's blocks are held.
        for req in reversed(self.pending_forks.pop(src.req_id, [])):
            self.waiting.appendleft(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        plan = _PlanBuilder()
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_new += self._trim_drafts(req, budget - num_new)
            while (new_ids := self.kv.allocate_slots(req, num_new)) is None:
                if req.spec_token_ids:  # drop the drafts before preempting anyone
                    num_new -= len(req.spec_token_ids)
                    req.spec_token_ids = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is req:
                    break
            if new_ids is None:
                break
            self._plan(plan, req, num_new)
            budget -= num_new
            i += 1

        # Admit waiting requests only when nothing was preempted: memory is short this step.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if self.kv.is_swapped(req):
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                if self.kv.swap_in(req, num_new) is None:
                    break
                self._admit(req)
                self._plan(plan, req, num_new)
                budget -= num_new
                continue
            src = self.fork_source.pop(req.req_id, None)
            if src is not None and self._try_fork(src, req):
                num_new = req.num_tokens - req.num_computed_tokens
                if self.kv.allocate_slots(req, num_new) is None:
                    self.kv.free(req)
                    req.num_computed_tokens = 0
                    break
                self._admit(req)
                self._plan(plan, req, num_new)
                budget -= num_new
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            self.kv.record_prefix_query(req, num_hit_tokens)
            req.num_computed_tokens = num_hit_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit_tokens
            self._admit(req)
            self._plan(plan, req, num_new)
            budget -= num_new

        finished, self._finished_since_plan = self._finished_since_plan, []
        return SchedulerOutput(plan.new_reqs, plan.cached, plan.num_scheduled_tokens,
                               self.config.max_num_batched_tokens - budget, preempted, finished,
                               self.kv.take_block_ops(), plan.num_prompt_tokens, plan.num_sampling_reqs,
                               plan.spec_tokens)

    def _trim_drafts(self, req: Request, budget_left: int) -> int:
        # Drafts ride only on a decode step (all tokens but the last computed) and never reach past the
        # request's last possible token: with a accepted drafts the step emits a + 1 tokens.
        if not req.spec_token_ids:
            return 0
        room = min(self.max_model_len, req.num_prompt_tokens + req.max_tokens) - req.num_tokens - 1
        if req.num_computed_tokens != req.num_tokens - 1:
            room = 0
        del req.spec_token_ids[max(0, min(room, budget_left)):]
        return len(req.spec_token_ids)

    def _admit(self, req: Request) -> None:
        self.waiting.popleft()
        if req.scheduled_time is None:  # queue time ends here, before the prefill runs
            req.scheduled_time = time.monotonic()
        if req.status is RequestStatus.PREEMPTED:
            self._worker_views[req.req_id].num_blocks = 0
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _try_fork(self, src: Request, req: Request) -> bool:
        # Share src's computed prompt blocks; req then computes only its last prompt token, whose logits
        # it samples from with its own seed.
        num_shared = req.num_prompt_tokens - 1
        if (num_shared < 1 or src.status is not RequestStatus.RUNNING
                or src.num_computed_tokens < num_shared or req.num_tokens != req.num_prompt_tokens):
            return False
        self.kv.fork(src, req, num_shared)
        req.num_computed_tokens = num_shared
        return True

    def _plan(self, plan: _PlanBuilder, req: Request, num_new: int) -> None:
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
        blocks = self.kv.req_blocks[req.req_id]
        view = self._worker_views.get(req.req_id)
        if view is None:
            plan.new_reqs.append(NewRequestData(req.req_id, req.prompt_token_ids, req.params, req.eos_token_ids,
                                                [b.block_id for b in blocks], start))
            self._worker_views[req.req_id] = _WorkerView(req.num_tokens, len(blocks))
            return
        # A table known to the worker only grows at its end: copy-on-write replaces a block only in a table
        # the worker has not seen yet (a fork's first plan). tests/core check this against a mirror.
        c = plan.cached
        c.req_ids.append(req.req_id)
        c.resumed_from_preemption.append(view.num_blocks == 0)
        c.new_token_ids.append(req.all_token_ids[view.num_tokens:])
        c.new_block_ids.append([b.block_id for b in blocks[view.num_blocks:]])
        c.num_computed_tokens.append(start)
        view.num_tokens, view.num_blocks = req.num_tokens, len(blocks)

    def _preempt(self, req: Request) -> None:
        if self.preemption_mode == "swap" and self.kv.can_swap_out(req):
            self.kv.swap_out(req)  # keeps num_computed_tokens: the K/V comes back with the blocks
            self.num_preemptions_swap += 1
        else:
            self.kv.free(req, finished=False)
            req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests. Returns requests with a new token."""
        sampled = dict(zip(result.req_ids, range(len(result.req_ids))))
        updated: list[Request] = []
        for req_id, num_new in plan.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status is not RequestStatus.RUNNING:  # finished while the step ran
                continue
            req.num_computed_tokens += num_new
            if req.num_computed_tokens < req.num_tokens:
                self.kv.cache_blocks(req)
                continue
            j = sampled[req.req_id]
            status = self._append_step_tokens(req, plan.scheduled_spec_decode_tokens.get(req_id, ()), result, j)
            if req.req_id in self.pending_forks:
                self._release_forks(req)
            if status is not None:
                self.finish_request(req.req_id, status)
            updated.append(req)
        return updated

    def _append_step_tokens(self, req: Request, drafts, result: ModelRunnerOutput, j: int) -> RequestStatus | None:
        # The step emits the accepted drafts and then the sampled token, stopping at the first that ends the
        # request (a stop token, min/max tokens, max_model_len).
        #
        #   scheduled:  [last][d1][d2][d3]       accepted d1, d2; d3 rejected
        #   K/V kept:   [last][d1][d2]           num_computed rolls back over d3: its slot is written again
        #   emitted:         d1  d2  x           x: the recovered token sampled at d3's position
        accepted: list[int] = []
        spec = result.spec
        if drafts:
            accepted = spec.accepted_token_ids[j]
            req.num_computed_tokens -= len(drafts) - len(accepted)
        req.spec_token_ids = []
        tokens = accepted + [result.sampled_token_ids[j]]
        status = None
        for i, token in enumerate(tokens):
            req.append_token(token)
            if result.logprobs is not None:
                last = i == len(tokens) - 1
                req.cumulative_logprob += result.logprobs[j] if last else spec.logprobs[j][i]
            status = req.check_stop(self.max_model_len)
            if status is not None:
                break
        # A truncated step computed K/V past its last emitted token; only the emitted tokens are known.
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        # Only now: blocks hashed into the prefix cache hold verified tokens only.
        self.kv.cache_blocks(req)
        return status

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        src = self.fork_source.pop(req_id, None)
        if src is not None and req in self.pending_forks.get(src.req_id, ()):
            self.pending_forks[src.req_id].remove(req)
        # Forks still waiting on this request fall back to an ordinary prefill (prefix cache hits).
        for fork in self.pending_forks.pop(req_id, []):
            self.fork_source.pop(fork.req_id, None)
            self.waiting.append(fork)
        req.status = status
        self.kv.free(req)
        if self._worker_views.pop(req_id, None) is not None:
            self._finished_since_plan.append(req_id)
        return req

    def stats(self) -> SchedulerStats:
        ps = self.kv.prefix_stats
        kv = self.kv
        num_pending = sum(len(forks) for forks in self.pending_forks.values())
        return SchedulerStats(len(self.running), len(self.waiting) + num_pending, kv.usage(),
                              self.num_preemptions_total, ps.num_queries, ps.num_hits,
                              kv.pool.num_free_blocks, kv.num_blocks, kv.pool.num_shared_blocks,
                              kv.num_cow_copies, kv.num_swapped_out_blocks, kv.num_swapped_in_blocks,
                              self.num_preemptions_swap, len(kv.swapped),
                              kv.disk.snapshot() if kv.disk is not None else None)
