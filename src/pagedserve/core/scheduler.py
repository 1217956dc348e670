"""Continuous batching: every step, running requests first, then waiting ones, under a token budget.

Each scheduled request catches its num_computed_tokens up towards num_tokens by at most the remaining
budget (chunked prefill). When the pool is short the last running request (the newest; under the priority
policy the least urgent) is preempted: by recompute (blocks freed, tokens kept, computed again later) or, with
preemption_mode="swap" and room in the host pool, by swapping its blocks out and back in. Either way it waits
again (core/waiting_queue.py: who is admitted next, fair between client requests; core/scheduling_policy.py:
fcfs or priority, where a waiting request may also preempt less urgent running ones; docs/scheduling.md).
A request preempted for a more urgent one only because the batch is full (max_num_seqs) while the pool has
room is paused: it keeps its blocks and computed tokens and resumes where it stopped. Paused requests give their
blocks back (and are recomputed later) before any running request is preempted for memory.

Parallel samples of one prompt are forks: the first sample prefills the prompt; the others wait until it
has, then share its blocks (the last, partly filled one copy-on-write) and compute only the last token.

A longrope model (Phi-3) turns a sequence of more than `longrope_switch` tokens with its long factors at every
position, a shorter one with its short factors (model/layers/rotary.py), as transformers does. When a running
request grows past the switch, its K/V (computed with the short factors) is dropped and computed again, as a
preemption by recompute; the worker picks the factors from the request's length, which the plan gives it.

Urgent steps (priority policy): when requests arrive while a step is in flight, the engine core asks between its
layers for a plan of the waiting requests that outrank every request in it (schedule_urgent) and runs it there,
so an urgent prompt waits for one layer of a long low-priority step instead of all of it
(engine/urgent_steps.py). That plan admits only such requests, beside the batch and without touching the step in
flight, so the batch may hold more than max_num_seqs until the next step, which pauses the least urgent requests
above it.

Plans describe requests to the worker by difference (core/plan_builder.py).
"""
from __future__ import annotations

import time

from pagedserve.config import SchedulerConfig
from pagedserve.core import token_budget
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.plan_builder import PlanBuilder, WorkerViews
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from pagedserve.core.scheduling_policy import make_policy
from pagedserve.core.waiting_queue import WaitingQueue


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 preemption_mode: str = "recompute", longrope_switch: int | None = None) -> None:
        self.config = config
        self.longrope_switch = longrope_switch
        self.kv = kv
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.num_preemptions_swap = 0
        # Preempted requests that kept their blocks (_preempt_for_waiting), in the order they were paused.
        self.paused: dict[str, Request] = {}
        # Forked samples waiting for their source's prefill, keyed by the source's req_id.
        self.pending_forks: dict[str, list[Request]] = {}
        self.fork_source: dict[str, Request] = {}
        self.policy = make_policy(config.scheduling_policy, config.priority_aging_steps)
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self._finished_since_plan: list[str] = []
        self.views = WorkerViews()
        # While schedule_urgent plans: the requests of the step in flight, which every admitted one outranks.
        self._in_flight: list[Request] | None = None

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
        req.long_rope = self.longrope_switch is not None and req.num_tokens > self.longrope_switch
        self.requests[req.req_id] = req
        if fork_of is not None and fork_of.req_id in self.requests and not fork_of.output_token_ids:
            self.pending_forks.setdefault(fork_of.req_id, []).append(req)
            self.fork_source[req.req_id] = fork_of
        else:
            self.waiting.add(req)

    def _release_forks(self, src: Request) -> None:
        # Forks go to the front of the queue, so they are admitted while src's blocks are held.
        for req in self.pending_forks.pop(src.req_id, []):
            self.waiting.add_front(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        plan = PlanBuilder()
        preempted: list[str] = []
        self.waiting.now += 1
        self.policy.order_running(self.running)
        while len(self.running) > self.config.max_num_seqs:  # urgent steps added to a full batch: back to size
            victim = self.running.pop()
            self._preempt(victim, pause=True)
            preempted.append(victim.req_id)
        num_admissible = min(len(self.waiting), self.config.max_num_seqs - len(self.running))
        budget = step_budget = token_budget.step_budget(self.config, self.running, num_admissible)
        self._preempt_for_waiting(preempted, budget)
        num_preempted_for_waiting = len(preempted)
        # Long prefills capped to the threshold: (request, tokens given, tokens wanted), planned last (_top_up).
        capped: list[tuple[Request, int, int]] = []

        # Under the priority policy a running prefill pauses while a waiting request outranks it, so the
        # budget goes to the urgent one's prefill; decodes always run. And a step that computes a prompt
        # computes no less urgent one beside it (policy.holds_back): the urgent prompt's first token comes
        # after this step, which the other prompt would make longer.
        urgent = self.waiting.peek()
        lead: Request | None = None  # the most urgent request whose prompt this step computes
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._passes_longrope_switch(req):  # its K/V is computed again, with the long factors
                self.running.pop(i)
                self._preempt(req, recompute=True)
                preempted.append(req.req_id)
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new > 1 and ((urgent is not None and self.policy.outranks(urgent, req, self.waiting.now))
                                or self.policy.holds_back(lead, req)):
                i += 1
                continue
            wanted, num_new = num_new, self._cap_prefill(num_new)
            num_new += self._trim_drafts(req, budget - num_new)
            while (new_ids := self.kv.allocate_slots(req, num_new)) is None:
                if req.spec_token_ids:  # drop the drafts before preempting anyone
                    num_new -= len(req.spec_token_ids)
                    req.spec_token_ids = []
                    continue
                if self._drop_paused():
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is req:
                    break
            if new_ids is None:
                break
            if wanted > num_new:
                capped.append((req, num_new, wanted))
            else:
                self._plan(plan, req, num_new)
            if wanted > 1:
                lead = self._lead(lead, req)
            budget -= num_new
            i += 1

        # Admit waiting requests only when no running one was preempted for memory: it is short this step.
        # A request preempted this step waits at least until the next (the worker drops its rows first).
        deferred: list[Request] = []  # waiting for a running prefill's blocks (_waits_for_running_prefill)
        while (len(preempted) == num_preempted_for_waiting and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting.peek()
            if req.req_id in preempted or (self._in_flight is not None and not self._outranks_all(req)):
                break
            if (self.policy.holds_back(lead, req) and req.num_tokens - req.num_computed_tokens > 1
                    and req.req_id not in self.fork_source):  # a fork computes one token
                break
            if self.kv.is_swapped(req) or req.req_id in self.paused:
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                if req.req_id in self.paused:
                    if not self._allocate(req, num_new):
                        break
                    del self.paused[req.req_id]
                elif self.kv.swap_in(req, num_new) is None:
                    break
                self._admit(req)
                self._plan(plan, req, num_new)
                if num_new > 1:
                    lead = self._lead(lead, req)
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
            if self._waits_for_running_prefill(req, num_hit_tokens, num_new):
                deferred.append(self.waiting.pop())
                continue
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            wanted = min(num_new, budget)
            num_new = self._cap_prefill(wanted)
            if not self._allocate(req, num_new, hits):
                break
            self.kv.record_prefix_query(req, num_hit_tokens)
            req.num_computed_tokens = num_hit_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit_tokens
            self._admit(req)
            if wanted > num_new:
                capped.append((req, num_new, wanted))
            else:
                self._plan(plan, req, num_new)
            if wanted > 1:
                lead = self._lead(lead, req)
            budget -= num_new

        for req in deferred:  # back in the queue with their keys: their places are kept
            self.waiting.add(req)
        budget = self._top_up(plan, capped, budget)
        finished, self._finished_since_plan = self._finished_since_plan, []
        return SchedulerOutput(plan.new_reqs, plan.cached, plan.num_scheduled_tokens,
                               step_budget - budget, preempted, finished,
                               self.kv.take_block_ops(), plan.num_prompt_tokens, plan.num_sampling_reqs,
                               plan.spec_tokens)

    def schedule_urgent(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """Between the layers of the step in flight (in_flight, not updated yet): a plan of the waiting requests
        that outrank every request it computes, or None when the queue's head does not. The plan leaves the step's
        requests (and every other running one) alone: it admits urgent requests beside them."""
        if not self.policy.preempts_for_waiting or not self.waiting:
            return None
        self._in_flight = [self.requests[r] for r in in_flight.num_scheduled_tokens if r in self.requests]
        running, self.running = self.running, []
        try:
            if not self._outranks_all(self.waiting.peek()):
                return None
            return self.schedule()
        finally:
            self.running = running + self.running
            self._in_flight = None

    def _outranks_all(self, req: Request) -> bool:
        return all(self.policy.outranks(req, r, self.waiting.now) for r in self._in_flight)

    def _lead(self, lead: Request | None, req: Request) -> Request:
        # The most urgent of the requests whose prompts this step computes.
        return req if lead is None or self.policy.holds_back(req, lead) else lead

    def _allocate(self, req: Request, num_new: int, hits=None) -> bool:
        # Slots for a request being admitted; paused requests give their blocks back first if the pool is short.
        while self.kv.allocate_slots(req, num_new, hits) is None:
            if not self._drop_paused(keep=req):
                return False
        return True

    def _drop_paused(self, keep: Request | None = None) -> bool:
        # The pool is short: the most recently paused request (other than keep) frees its blocks and will be
        # computed again, as one preempted by recompute. False when there is none.
        victim = next((r for r in reversed(self.paused.values()) if r is not keep), None)
        if victim is None:
            return False
        del self.paused[victim.req_id]
        self.kv.free(victim, finished=False)
        victim.num_computed_tokens = 0
        return True

    def _waits_for_running_prefill(self, req: Request, num_hit_tokens: int, num_new: int) -> bool:
        # A running request still prefilling the same prefix (a shared system prompt, requests sent together)
        # will cache blocks that req would otherwise compute a second time in parallel. When they are at least
        # half of req's prefill, req waits until they are cached (it was not going to get its first token
        # sooner: that prefill is ahead of it) and the step's budget goes to other requests. Not for one it
        # outranks: that one pauses for req (priority policy).
        now = self.waiting.now
        for other in self.running:
            if other.num_computed_tokens >= other.num_prompt_tokens or self.policy.outranks(req, other, now):
                continue
            # Blocks of req's prompt that other computes and the cache does not hold yet (cached after each step)
            gain = self.kv.num_shared_prefix_tokens(req, other) - num_hit_tokens
            if gain > 0 and 2 * gain >= num_new:
                return True
        return False

    def _cap_prefill(self, num_new: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if not threshold or not self.config.enable_chunked_prefill:
            return num_new
        return min(num_new, threshold)

    def _top_up(self, plan: PlanBuilder, capped: list[tuple[Request, int, int]], budget: int) -> int:
        # What the step has left goes back to the prefills capped at the threshold, in batch order.
        for req, num_new, wanted in capped:
            extra = min(wanted - num_new, budget)
            if extra > 0 and self.kv.allocate_slots(req, num_new + extra) is not None:
                num_new += extra
                budget -= extra
            self._plan(plan, req, num_new)
        return budget

    def _trim_drafts(self, req: Request, budget_left: int) -> int:
        # Drafts ride only on a decode step (all tokens but the last computed) and never reach past the
        # request's last possible token: with a accepted drafts the step emits a + 1 tokens.
        if not req.spec_token_ids:
            return 0
        room = min(self.max_model_len, req.num_prompt_tokens + req.max_tokens) - req.num_tokens - 1
        if req.num_computed_tokens != req.num_tokens - 1:
            room = 0
        if self.longrope_switch is not None and not req.long_rope:  # short factors: positions below the switch
            room = min(room, self.longrope_switch - req.num_tokens)
        del req.spec_token_ids[max(0, min(room, budget_left)):]
        return len(req.spec_token_ids)

    def _preempt_for_waiting(self, preempted: list[str], budget: int) -> None:
        # Priority policy: while the batch or the pool has no room for the first chunk of the most urgent
        # waiting request, the least urgent running request it outranks (running is in order) is preempted:
        # paused (blocks kept) when only the batch is full, else as the mode says once no paused request has
        # blocks to give back. Room is estimated before the running requests allocate: their next tokens come
        # first. A paused request at the head takes its turn from one of its priority that ran TURN_STEPS more.
        now = self.waiting.now
        while self.policy.preempts_for_waiting and self.waiting and self.running:
            req = self.waiting.peek()
            has_blocks = self._has_blocks(req, budget)
            if has_blocks and len(self.running) < self.config.max_num_seqs:
                return
            if not has_blocks and self._drop_paused(keep=req):
                continue
            victim = next((r for r in reversed(self.running) if self.policy.outranks(req, r, now)
                           or (req.req_id in self.paused and self.policy.takes_turn(req, r, now))), None)
            if victim is None:
                return
            self.running.remove(victim)
            self._preempt(victim, pause=has_blocks)
            preempted.append(victim.req_id)

    def _has_blocks(self, req: Request, budget: int) -> bool:
        kv = self.kv

        def blocks_for(r: Request) -> int:
            num_new = min(r.num_tokens - r.num_computed_tokens, budget) + len(r.spec_token_ids)
            held = 0 if kv.is_swapped(r) else len(kv.req_blocks.get(r.req_id, ()))
            return max(0, -(-(r.num_computed_tokens + num_new) // kv.block_size) - held)

        num_needed = blocks_for(req) + sum(blocks_for(r) for r in self.running)
        return num_needed <= kv.free_blocks_for(num_needed)

    def _admit(self, req: Request) -> None:
        self.waiting.pop()
        if req.scheduled_time is None:  # queue time ends here, before the prefill runs
            req.scheduled_time = time.monotonic()
        req.admitted_step = self.waiting.now
        if req.status is RequestStatus.PREEMPTED:
            self.views.resumed(req.req_id)
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

    def _plan(self, plan: PlanBuilder, req: Request, num_new: int) -> None:
        self.views.add(plan, req, num_new, self.kv.block_ids(req.req_id))

    def _passes_longrope_switch(self, req: Request) -> bool:
        # True when req has just grown past the longrope switch with K/V computed (with the short factors):
        # from now on it uses the long factors, under another prefix-cache key.
        if self.longrope_switch is None or req.long_rope or req.num_tokens <= self.longrope_switch:
            return False
        req.long_rope = True
        self.kv.forget_hashes(req)
        return req.num_computed_tokens > 0

    def _preempt(self, req: Request, recompute: bool = False, pause: bool = False) -> None:
        # recompute: drop the K/V whatever the mode. So it is when req has just passed the longrope switch:
        # what it would swap out was computed with the wrong factors. pause: keep the blocks (the pool has room).
        recompute = self._passes_longrope_switch(req) or recompute
        if pause and not recompute:
            self.paused[req.req_id] = req
        elif self.preemption_mode == "swap" and not recompute and self.kv.can_swap_out(req):
            self.kv.swap_out(req)  # keeps num_computed_tokens: the K/V comes back with the blocks
            self.num_preemptions_swap += 1
        else:
            self.kv.free(req, finished=False)
            req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        req.queue_key = self.policy.requeue_key(req, self.waiting.now)
        self.waiting.add(req)

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
            self.waiting.add(fork)
        req.status = status
        self.paused.pop(req_id, None)
        self.kv.free(req)
        if self.views.drop(req_id):
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
