"""The engine core: scheduler + KV cache manager + an executor that runs its plans. Token ids in, token-id deltas
out; no text, no tensors.

One step: schedule -> executor runs the plan -> update requests -> one EngineCoreOutput per request that moved.

    front-end (Processor, OutputProcessor)          engine core (this module)
    EngineCoreRequest(s) of one user request  --->   add_requests: validate all, then add all
    RequestOutput <- detokenize, stop strings <---   step(): EngineCoreOutput(new_token_ids, logprobs, finish)
    finish_requests(ids) (stop string hit)    --->   free the blocks

Under the priority policy and the asyncio front-end, a step may run urgent requests' steps between its model
layers (engine/urgent_steps.py).

Start-up asks the executor's workers (worker/executor.py) for their KV spec and memory budget, sizes the pool,
and has every worker allocate it. Every per-request failure stays with its request: a step that raises is run
again one request at a time, and only the requests that still raise are failed (with the error in their
EngineCoreOutput).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from pagedserve.config import EngineConfig, resolve_limits
from pagedserve.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagedserve.core.kv_events import KVEventCollector
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput
from pagedserve.distributed.parallel_state import bind_rank
from pagedserve.engine.kv_event_publisher import make_publisher
from pagedserve.engine.urgent_steps import UrgentSteps
from pagedserve.messages import (Arrivals, EngineCoreOutput, EngineCoreRequest, EngineDeadError,
                                 RequestConstraintError, SampledLogprobs, describe_error)
from pagedserve.metrics.stats import EngineStats, RequestStats
from pagedserve.model.dtypes import resolve_engine_dtypes
from pagedserve.structured_output.manager import StructuredOutputManager
from pagedserve.worker.executor import Executor
from pagedserve.worker.kv_offload import open_disk_tier
from pagedserve.worker.memory import plan_num_blocks, plan_num_host_blocks
from pagedserve.worker.worker import KVCacheConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _StepFailures:
    errors: dict[str, str] = field(default_factory=dict)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        config = self.config = resolve_engine_dtypes(config)
        device = bind_rank(config, 0)
        self.kv, self.kv_event_publisher = None, None
        self.executor = make_executor(config, device)
        try:
            self._build(config, device, t0)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, device: torch.device, t0: float) -> None:
        ex = self.executor
        loaded = ex.loaded
        # The core never reads text; the front-end takes the loaded tokenizer and template from here.
        self.loaded, self.model_name, self.hf_config = loaded, loaded.model_name, loaded.hf_config
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, quantization=loaded.quantization))
        spec, draft = ex.kv_cache_spec(), ex.draft_kv()
        self.kv_bytes_per_token = spec.bytes_per_token
        logger.info("KV cache dtype %s: %d bytes per token (float32: %d)", spec.kv_dtype, spec.bytes_per_token,
                    dataclasses.replace(spec, kv_dtype="float32").bytes_per_token)
        num_blocks = plan_num_blocks(config.cache, spec.bytes_per_block, ex.kv_budget_bytes(), draft)
        num_host_blocks = plan_num_host_blocks(config.cache, spec.bytes_per_block, draft)
        # max_model_len and the token budget are final only now: checked against the model and the pool.
        config = self.config = resolve_limits(config, loaded.max_model_len, num_blocks)
        self.max_model_len = config.model.max_model_len
        bs = config.cache.block_size
        # KV events: the pool records what it caches and evicts; step() hands each step's events to the publisher.
        self.kv_events = KVEventCollector(bs) if config.kv_events is not None and config.kv_events.active else None
        disk = open_disk_tier(config, spec.bytes_per_block, draft.bytes_per_block if draft else 0)
        self.kv = KVCacheManager(num_blocks, bs, config.cache.enable_prefix_caching, num_host_blocks,
                                 kv_events=self.kv_events, disk=disk)
        self.kv_event_publisher = make_publisher(config.kv_events, config.model.model or self.model_name)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, config.cache.preemption_mode,
                                   getattr(loaded.model, "longrope_switch", None))
        self.structured_output = StructuredOutputManager(self.hf_config.vocab_size)
        ex.initialize(KVCacheConfig(num_blocks, num_host_blocks, self.max_model_len))
        self._disk_reader = ex.disk_block_reader() if self.kv.disk is not None else None
        self.stats = EngineStats()
        # Samples of one user request (a sample's group is the sample it forks, or itself), so metrics count
        # a request once when its last sample ends, as vLLM does.
        self._group_of: dict[str, str] = {}
        self._groups: dict[str, list[Request]] = {}
        self.arrivals: Arrivals | None = None  # set by the asyncio front-end (engine/urgent_steps.py)
        logger.info("loaded %s in %.1fs on %s; KV pool: %d blocks x %d tokens = %d tokens",
                    self.model_name, time.perf_counter() - t0, device, num_blocks, bs, num_blocks * bs)

    def shutdown(self) -> None:
        # Stops the tensor-parallel workers, writes out the disk tier's queue, stops the KV event publisher.
        self.executor.shutdown()
        if self.kv is not None and self.kv.disk is not None:
            self.kv.disk.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

    @property
    def runner(self):
        # Rank 0's model runner, for tests and benchmarks that inspect its batch and caches.
        return self.executor.model_runner

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """All or nothing: every check runs before the first request enters the scheduler."""
        seen: set[str] = set()
        for r in reqs:
            if r.req_id in self.scheduler.requests or r.req_id in seen:
                raise ValueError(f"request id {r.req_id!r} is already in use")
            seen.add(r.req_id)
            if r.fork_of is not None and r.fork_of not in seen:
                raise ValueError(f"request {r.req_id!r} forks {r.fork_of!r}, which is not added before it")
            self.scheduler.check_request(len(r.prompt_token_ids), r.max_tokens)
        by_id: dict[str, Request] = {}
        for r in reqs:
            req = Request(r.req_id, r.prompt_token_ids, r.params, r.max_tokens, r.eos_token_ids, r.arrival_time,
                          cache_salt=r.cache_salt, priority=r.priority, client_request_id=r.client_request_id)
            self.scheduler.add_request(req, fork_of=by_id.get(r.fork_of) if r.fork_of else None)
            if r.grammar is not None:
                self.structured_output.add_request(r.req_id, r.grammar)
            by_id[r.req_id] = req
            group = r.fork_of or r.req_id
            self._group_of[r.req_id] = group
            self._groups.setdefault(group, []).append(req)

    def finish_requests(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        # Aborts (client gone) and stop-string hits found by the front-end. Unknown ids are already done.
        for req_id in req_ids:
            req = self.scheduler.finish_request(req_id, status)
            if req is not None:
                self._record_finished(req)

    def _record_finished(self, req: Request) -> None:
        self.structured_output.remove(req.req_id)
        group = self._group_of.pop(req.req_id, None)
        samples = self._groups.get(group) if group is not None else None
        if samples is None or any(not s.status.is_finished for s in samples):
            return  # counted already (samples that ended in one step), or samples still running
        self._groups.pop(group, None)
        if any(s.status is RequestStatus.FINISHED_ABORTED for s in samples):
            self.stats.num_aborted += 1
        self.stats.record_finished(samples)

    def clear_warmup(self) -> None:
        # After the start-up warm-up (engine/warmup.py), which has finished: its blocks leave the prefix cache
        # and its requests and tokens the counters, so a server starts as if nothing had run.
        if self.kv.disk is not None:  # the writer reads blocks from the pool: pinned until it is done
            self.kv.disk.flush()
            self.kv.release_disk_pins()
        if self.scheduler.has_unfinished() or not self.kv.pool.reset_prefix_cache():
            raise RuntimeError("warm-up blocks are still in use")
        self.kv.prefix_stats = PrefixCacheStats()
        self.scheduler.num_preemptions_total = 0
        self.stats = EngineStats(on_finished=self.stats.on_finished)
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.kv_events.take())  # AllBlocksCleared after the warm-up's blocks

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def step(self) -> list[EngineCoreOutput]:
        if self.kv.disk is not None:
            self.kv.release_disk_pins()  # blocks the disk writer is done with are allocatable again
        plan = self.scheduler.schedule()
        return [] if plan.is_empty else self.run_plan(plan, UrgentSteps.for_step(self, plan))

    def run_plan(self, plan: SchedulerOutput, urgent: UrgentSteps | None = None) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        plan = self.structured_output.with_bitmask(plan, self.scheduler.requests)
        # A plan with no tokens still carries finished ids and swap copies: the worker applies them.
        t0 = time.perf_counter()
        failures = _StepFailures()
        result = self._execute(plan, failures, urgent)
        urgent_s = urgent.end() if urgent is not None else 0.0
        for req_id, message in failures.errors.items():
            req = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                self._record_finished(req)
                outputs.append(EngineCoreOutput(req_id, [], "error", error=message,
                                                stats=RequestStats.from_request(req)))
        requests = self.scheduler.requests
        num_before = {rid: requests[rid].num_output_tokens for rid in result.req_ids if rid in requests}
        updated = self.scheduler.update(plan, result)
        if self.kv.disk is not None:
            self.kv.write_disk_stores(*self._disk_reader)
        if self.structured_output.matchers:
            updated = self._accept_structured(updated, outputs)
        now = time.monotonic()
        row_of = {rid: j for j, rid in enumerate(result.req_ids)}
        num_emitted = 0
        for req in updated:
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            # One token per step, or with speculation the accepted drafts and the sampled token (cut at a stop).
            new_ids = req.output_token_ids[num_before[req.req_id]:]
            num_emitted += len(new_ids)
            out = EngineCoreOutput(req.req_id, new_ids, cumulative_logprob=req.cumulative_logprob,
                                   num_cached_tokens=req.num_cached_tokens)
            _attach_logprobs(out, req, result, row_of[req.req_id])
            if req.status.is_finished:
                out.finish_reason = req.status.value
                out.stop_reason = req.stop_reason
                self._record_finished(req)
            out.stats = RequestStats.from_request(req)
            outputs.append(out)
        if result.prompt_logprobs:
            outputs.extend(_prompt_logprob_outputs(result.prompt_logprobs, {o.req_id for o in outputs},
                                                   self.scheduler.requests))
        if result.spec is not None:
            self.stats.spec.record(result.spec)
        if result.draft_token_ids is not None:
            self._set_drafts(updated, result.draft_token_ids)
        self.stats.record_step(plan, self.scheduler.stats(), time.perf_counter() - t0 - urgent_s, num_emitted)
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.kv_events.take())
        return outputs

    def _drafts_pay(self) -> bool:
        # Above disable_by_batch_size running requests drafts would cost more compute than they save, so the
        # workers propose none (the draft model still catches up).
        spec = self.config.speculative
        return spec is None or spec.disable_by_batch_size is None or len(self.scheduler.running) <= spec.disable_by_batch_size

    def _set_drafts(self, updated: list[Request], draft_token_ids: dict[str, list[int]]) -> None:
        # The workers proposed each sampled request's drafts for the next step (n-gram or draft model).
        if not self._drafts_pay():
            return
        for req in updated:
            # A request under a grammar decodes one token a step: its matcher advances on emitted tokens only.
            if req.status is RequestStatus.RUNNING and req.req_id not in self.structured_output:
                req.spec_token_ids = list(draft_token_ids.get(req.req_id, ()))

    def _accept_structured(self, updated: list[Request], outputs: list[EngineCoreOutput]) -> list[Request]:
        # Each new token advances its sequence's matcher. The mask allowed only tokens the grammar accepts, so
        # a rejection is a bug that fails that request alone; a matcher that accepted its stop token is done.
        kept = []
        for req in updated:
            if req.req_id not in self.structured_output:
                kept.append(req)
                continue
            token = req.output_token_ids[-1]
            terminated_before = self.structured_output.is_terminated(req.req_id)
            if not terminated_before and not self.structured_output.accept_token(req.req_id, token):
                # The mask left no token (min_tokens forbids the end the grammar requires, allowed_token_ids
                # excludes what it needs, ...), so the sampler drew from nothing.
                message = (f"{RequestConstraintError.PREFIX} (min_tokens, allowed_token_ids, logit_bias) after "
                           f"{len(req.output_token_ids) - 1} output tokens")
                self.finish_requests([req.req_id])
                outputs.append(EngineCoreOutput(req.req_id, [], "error", error=message,
                                                stats=RequestStats.from_request(req)))
                continue
            if self.structured_output.is_terminated(req.req_id) and not req.status.is_finished:
                self.scheduler.finish_request(req.req_id, RequestStatus.FINISHED_STOPPED)
            kept.append(req)
        return kept

    def _execute(self, plan: SchedulerOutput, failures: _StepFailures,
                 urgent: UrgentSteps | None) -> ModelRunnerOutput:
        # The plan's bookkeeping is applied once; a failure there is the engine's, not a request's. urgent runs
        # between the layers of the first try only.
        self.executor.apply_plan(plan)
        scheduled, propose_drafts = plan.num_scheduled_tokens, self._drafts_pay()
        try:
            return self.executor.execute_model(scheduled, propose_drafts, urgent)
        except EngineDeadError:
            raise  # no step can run any more: not a request's failure
        except Exception as exc:  # noqa: BLE001 (contained below, per request)
            if len(scheduled) == 1:
                failures.errors[next(iter(scheduled))] = describe_error(exc)
                return ModelRunnerOutput([], [])
            logger.warning("a step of %d requests failed (%s); running them one at a time",
                           len(scheduled), describe_error(exc))
        parts: list[ModelRunnerOutput] = []
        for req_id, num_tokens in scheduled.items():
            try:
                parts.append(self.executor.execute_model({req_id: num_tokens}, propose_drafts))
            except EngineDeadError:
                raise
            except Exception as exc:  # noqa: BLE001
                logger.exception("request %s failed inside a step", req_id)
                failures.errors[req_id] = describe_error(exc)
        return ModelRunnerOutput.merge(parts)


def _prompt_logprob_outputs(chunks: dict[str, PromptLogprobsChunk], taken: set[str],
                            requests: dict[str, Request]) -> list[EngineCoreOutput]:
    # Prompt logprobs of requests whose step sampled nothing (a prompt chunk short of its end).
    extra = []
    for req_id, chunk in chunks.items():
        if req_id in taken:
            continue  # travels with the request's sampled token
        req = requests.get(req_id)
        if req is not None:
            extra.append(EngineCoreOutput(req_id, [], prompt_logprobs=chunk, num_cached_tokens=req.num_cached_tokens))
    return extra


def _attach_logprobs(out: EngineCoreOutput, req: Request, result: ModelRunnerOutput, j: int) -> None:
    # The prompt logprobs computed for req this step, and the logprobs of the tokens it emits (row j).
    if result.prompt_logprobs:
        out.prompt_logprobs = result.prompt_logprobs.get(req.req_id)
    if result.logprobs is not None and req.params.logprobs is not None:
        out.new_logprobs = _emitted_logprobs(result, j, len(out.new_token_ids))


def _emitted_logprobs(result: ModelRunnerOutput, j: int, num_tokens: int) -> SampledLogprobs:
    # The accepted drafts' logprobs come first, then the sampled token's; a stop can cut the list short.
    logprobs = [result.logprobs[j]]
    ranks = [result.ranks[j] if result.ranks is not None else None]
    top = [result.top_logprobs[j] if result.top_logprobs is not None else []]
    spec = result.spec
    if spec is not None and spec.logprobs is not None and spec.accepted_token_ids[j]:
        logprobs = spec.logprobs[j] + logprobs
        ranks = spec.ranks[j] + ranks
        top = spec.top_logprobs[j] + top
    return SampledLogprobs(logprobs[:num_tokens], ranks[:num_tokens], top[:num_tokens])


def make_executor(config: EngineConfig, device: torch.device) -> Executor:
    # Ranks 1..N-1 run in their own processes (distributed/); one worker in this process otherwise.
    if config.parallel.tensor_parallel_size == 1:
        return Executor(config, device)
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":
        raise ValueError("speculative method 'draft_model' does not support tensor_parallel_size > 1 yet")
    from pagedserve.distributed.executor import MultiprocExecutor  # spawns processes: only when asked for

    return MultiprocExecutor(config, device)
