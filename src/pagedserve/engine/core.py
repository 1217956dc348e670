"""The engine core: scheduler + KV cache manager + model runner. Token ids in, token-id deltas out; no text.

One step: schedule -> run the model -> update requests -> one EngineCoreOutput per request that moved.

    front-end (Processor, OutputProcessor)          engine core (this module)
    EngineCoreRequest(s) of one user request  --->   add_requests: validate all, then add all
    RequestOutput <- detokenize, stop strings <---   step(): EngineCoreOutput(new_token_ids, logprobs, finish)
    finish_requests(ids) (stop string hit)    --->   free the blocks

Every per-request failure stays with its request: a step that raises is run again one request at a time,
and only the requests that still raise are failed (with the error in their EngineCoreOutput).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.config import EngineConfig, resolve_limits
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_events import KVEventCollector
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import (ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput,
                                              SpecDecodeOutput)
from pagedserve.distributed.executor import DistributedRunner
from pagedserve.distributed.parallel_state import rank_device, threads_per_rank
from pagedserve.engine.kv_event_publisher import make_publisher
from pagedserve.engine.output_stream import EngineDeadError, RequestConstraintError
from pagedserve.metrics.stats import EngineStats, RequestStats
from pagedserve import kv_dtypes
from pagedserve.attention.kv_quant import storage_dtype
from pagedserve.model.dtypes import resolve_dtype
from pagedserve.model.loader import load_model, read_config, resolve_model_dir
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.draft_model import (DraftModel, check_same_vocab, draft_dtype, load_draft,
                                                 num_scratch_blocks)
from pagedserve.spec_decode.proposer import make_proposer
from pagedserve.structured_output.manager import StructuredOutputManager
from pagedserve.worker.kv_cache import allocate_host_caches, allocate_kv_caches, kv_bytes_per_block
from pagedserve.worker.kv_offload import open_disk_tier, store_cached_blocks
from pagedserve.worker.memory import DraftKV, plan_num_blocks
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    # One sequence the core generates. A user request with n samples is n of these; samples after the first
    # name it in fork_of, so they share its prompt blocks instead of computing the prompt again.
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    fork_of: str | None = None
    cache_salt: str | None = None  # requests with different salts never share prefix-cache blocks
    grammar: Any = None  # an xgrammar CompiledGrammar, compiled by the front-end before the request is added
    priority: int = 0  # lower first under --scheduling-policy priority
    client_request_id: str | None = None  # the client request it belongs to: the scheduler is fair between them


@dataclass(frozen=True, slots=True)
class SampledLogprobs:
    # For each new token: its logprob, its rank, and the top (token id, logprob) alternatives.
    logprobs: list[float]
    ranks: list[int | None]
    top: list[list[tuple[int, float]]]


@dataclass(slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None          # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None      # the stop token id that ended it
    new_logprobs: SampledLogprobs | None = None
    prompt_logprobs: PromptLogprobsChunk | None = None
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0
    error: str | None = None                  # set with finish_reason "error"
    stats: RequestStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _StepFailures:
    errors: dict[str, str] = field(default_factory=dict)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device = torch.device(config.device.resolve())
        # dtype and KV dtype are resolved here, before any rank starts, so every rank builds the same model.
        dtype, why = resolve_dtype(config.model.dtype, device)
        dtype_name = str(dtype).removeprefix("torch.")
        logger.info("model dtype %s (%s)", dtype_name, why)
        kv_name = kv_dtypes.resolve(config.cache.cache_dtype, dtype_name)
        storage_dtype(kv_name)  # ValueError naming the flag where this torch lacks the type
        if kv_name == "float16" and config.model.attention_backend == "cpu":
            raise ValueError(f"--kv-cache-dtype {kv_name} needs --attention-backend auto or reference: the "
                             "compiled 'cpu' backend reads float32, bfloat16, int8 and fp8_e4m3 caches")
        config = self.config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype_name),
                                                   cache=dataclasses.replace(config.cache, cache_dtype=kv_name))
        tp_size = config.parallel.tensor_parallel_size
        # Ranks 1..N-1 run in their own processes (distributed/); None when the model runs here alone.
        if tp_size > 1:
            device = rank_device(device, 0)
        self.executor = start_executor(config, device) if tp_size > 1 else None
        self.kv_event_publisher = None
        try:
            self._build(config, device)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, device: torch.device) -> None:
        tp_size = config.parallel.tensor_parallel_size
        if config.device.num_threads or tp_size > 1:
            torch.set_num_threads(threads_per_rank(config.device.num_threads, tp_size))
        dtype = getattr(torch, config.model.dtype)
        kv_name = config.cache.cache_dtype
        kv_dtype = storage_dtype(kv_name)
        t0 = time.perf_counter()
        loaded = load_model(config.model.model, device, dtype, config.model.attention_backend,
                            config.model.tokenizer, config.model.quantization,
                            tp=self.executor.tp if self.executor else None, load_format=config.model.load_format)
        config = self.config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, quantization=loaded.quantization))
        if self.executor:
            self.executor.wait_loaded()
        # The core never reads text; the front-end takes the loaded tokenizer and template from here.
        self.loaded = loaded
        self.model_name = loaded.model_name
        self.hf_config = hf = loaded.hf_config
        num_kv_heads = hf.num_key_value_heads // tp_size  # each rank holds its KV heads of every block
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        bs = config.cache.block_size
        self.kv_bytes_per_token = kv_dtypes.bytes_per_token(kv_name, hf.num_hidden_layers, num_kv_heads, head_dim)
        logger.info("KV cache dtype %s: %d bytes per token (float32: %d)", kv_name, self.kv_bytes_per_token,
                    kv_dtypes.bytes_per_token("float32", hf.num_hidden_layers, num_kv_heads, head_dim))
        draft_kv = self._draft_kv(dtype)
        num_blocks = plan_num_blocks(config.cache, hf.num_hidden_layers, num_kv_heads, head_dim, kv_dtype, device,
                                     draft_kv)
        # max_model_len and the token budget are final only now: checked against the model and the pool.
        config = self.config = resolve_limits(config, loaded.max_model_len, num_blocks)
        max_len = self.max_model_len = config.model.max_model_len
        kv_caches = allocate_kv_caches(hf.num_hidden_layers, num_blocks, bs, num_kv_heads, head_dim, kv_dtype,
                                       device, config.cache.prefault_kv_cache)
        per_block = kv_bytes_per_block(hf.num_hidden_layers, bs, num_kv_heads, head_dim, kv_dtype)
        # The swap space holds the draft's copy of each swapped block as well.
        num_host_blocks = int(config.cache.swap_space_gib * (1 << 30)) // (
            per_block + (draft_kv.bytes_per_block if draft_kv else 0))
        if config.cache.preemption_mode == "swap" and num_host_blocks == 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of host memory)")
        # KV events: the pool records what it caches and evicts; step() hands each step's events to the publisher.
        self.kv_events = KVEventCollector(bs) if config.kv_events is not None and config.kv_events.active else None
        self.kv = KVCacheManager(num_blocks, bs, config.cache.enable_prefix_caching, num_host_blocks,
                                 kv_events=self.kv_events, disk=open_disk_tier(config, per_block))
        self.kv_event_publisher = make_publisher(config.kv_events, config.model.model or self.model_name)
        self.scheduler = Scheduler(config.scheduler, self.kv, max_len, config.cache.preemption_mode,
                                   getattr(loaded.model, "longrope_switch", None))
        self.runner = ModelRunner(loaded.model, kv_caches, bs, hf.vocab_size, device,
                                  config.scheduler.max_num_seqs, max_len, config.model.seed)
        # Grammar matchers live beside the scheduler; the runner masks logits with them before sampling.
        self.structured_output = self.runner.structured_output = StructuredOutputManager(
            hf.vocab_size, config.scheduler.max_num_seqs)
        if num_host_blocks:
            self.runner.host_caches = allocate_host_caches(hf.num_hidden_layers, num_host_blocks, bs,
                                                           num_kv_heads, head_dim, kv_dtype, device)
        if self.executor:
            self.executor.init_cache(config, num_blocks, num_host_blocks)
            self.runner = DistributedRunner(self.runner, self.executor)
        self.stats = EngineStats()
        self.proposer = make_proposer(config.speculative)
        self._draft_model = config.speculative is not None and config.speculative.method == "draft_model"
        if self._draft_model:
            if self.executor:
                raise ValueError("speculative method 'draft_model' does not support tensor_parallel_size > 1 yet")
            self.runner.drafter = self._load_draft(loaded, num_blocks, num_host_blocks, device, dtype)
        # Samples of one user request (a sample's group is the sample it forks, or itself), so metrics count
        # a request once when its last sample ends, as vLLM does.
        self._group_of: dict[str, str] = {}
        self._groups: dict[str, list[Request]] = {}
        logger.info("loaded %s in %.1fs on %s; KV pool: %d blocks x %d tokens = %d tokens",
                    self.model_name, time.perf_counter() - t0, device, num_blocks, bs, num_blocks * bs)

    def _draft_kv(self, dtype: torch.dtype) -> DraftKV | None:
        # The draft model's KV bytes per mirrored block, from its config alone (before any weight loads):
        # the memory plan counts them inside the KV budget.
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        hf = read_config(resolve_model_dir(spec.model)[0])
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        bs = self.config.cache.block_size
        per_block = kv_bytes_per_block(hf.num_hidden_layers, bs, hf.num_key_value_heads, head_dim,
                                       draft_dtype(spec, dtype))
        return DraftKV(per_block, self.config.scheduler.max_num_seqs * num_scratch_blocks(
            spec.num_speculative_tokens, bs))

    def _load_draft(self, target, num_blocks: int, num_host_blocks: int, device: torch.device,
                    dtype: torch.dtype) -> DraftModel:
        # The draft's K/V mirrors the target's blocks (spec_decode/draft_model.py); the memory plan counted
        # it (_draft_kv).
        spec = self.config.speculative
        dtype = draft_dtype(spec, dtype)
        loaded = load_draft(spec, device, dtype, self.config.model.attention_backend,
                            self.config.model.tokenizer)
        check_same_vocab(target, loaded)
        drafter = DraftModel(loaded, spec.num_speculative_tokens, num_blocks, self.config.cache.block_size,
                             self.config.scheduler.max_num_seqs, self.max_model_len, dtype, device)
        if num_host_blocks:
            hf = loaded.hf_config
            drafter.host_caches = allocate_host_caches(
                hf.num_hidden_layers, num_host_blocks, self.config.cache.block_size, hf.num_key_value_heads,
                drafter.head_dim, dtype, device)
        logger.info("draft model %s (%s, quantization %s), %d speculative tokens", loaded.model_name,
                    dtype, loaded.quantization, spec.num_speculative_tokens)
        return drafter

    def shutdown(self) -> None:
        # Stops the tensor-parallel workers, writes out the disk tier's queue, stops the KV event publisher.
        if self.executor is not None:
            self.executor.shutdown()
        if getattr(self, "kv", None) is not None and self.kv.disk is not None:
            self.kv.disk.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs
        # A plan with no tokens still carries finished ids and swap copies: the worker applies them.
        t0 = time.perf_counter()
        failures = _StepFailures()
        if self._draft_model:
            limit = self.config.speculative.disable_by_batch_size
            self.runner.propose_drafts = limit is None or len(self.scheduler.running) <= limit
        result = self._execute(plan, failures)
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
            store_cached_blocks(self.kv, self.runner.kv_caches)
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
            j = row_of[req.req_id]
            if result.prompt_logprobs:
                out.prompt_logprobs = result.prompt_logprobs.get(req.req_id)
            if result.logprobs is not None and req.params.logprobs is not None:
                out.new_logprobs = _emitted_logprobs(result, j, len(new_ids))
            if req.status.is_finished:
                out.finish_reason = req.status.value
                out.stop_reason = req.stop_reason
                self._record_finished(req)
            out.stats = RequestStats.from_request(req)
            outputs.append(out)
        if result.prompt_logprobs:
            outputs.extend(self._prompt_logprob_outputs(result.prompt_logprobs, {o.req_id for o in outputs}))
        if result.spec is not None:
            self.stats.spec.record(result.spec)
        if self.proposer is not None or result.draft_token_ids is not None:
            self._propose(updated, result.draft_token_ids)
        self.stats.record_step(plan, self.scheduler.stats(), time.perf_counter() - t0, num_emitted)
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.kv_events.take())
        return outputs

    def _propose(self, updated: list[Request], draft_token_ids: dict[str, list[int]] | None) -> None:
        # Drafts for the next step. Above disable_by_batch_size running requests they would cost more
        # compute than they save, so that step decodes without them.
        limit = self.config.speculative.disable_by_batch_size
        if limit is not None and len(self.scheduler.running) > limit:
            return
        for req in updated:
            # A request under a grammar decodes one token a step: its matcher advances on emitted tokens only.
            if req.status is not RequestStatus.RUNNING or req.req_id in self.structured_output:
                continue
            if self.proposer is not None:
                req.spec_token_ids = self.proposer.propose(req.all_token_ids)
            else:  # the draft model proposed inside the step, from the token the step sampled
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

    def _prompt_logprob_outputs(self, chunks: dict[str, PromptLogprobsChunk],
                                taken: set[str]) -> list[EngineCoreOutput]:
        extra = []
        for req_id, chunk in chunks.items():
            if req_id in taken:
                continue  # travels with the request's sampled token
            req = self.scheduler.requests.get(req_id)
            if req is not None:
                extra.append(EngineCoreOutput(req_id, [], prompt_logprobs=chunk,
                                              num_cached_tokens=req.num_cached_tokens))
        return extra

    def _execute(self, plan: SchedulerOutput, failures: _StepFailures) -> ModelRunnerOutput:
        # The plan's bookkeeping is applied once; a failure there is the engine's, not a request's.
        self.runner.update_states(plan)
        scheduled = plan.num_scheduled_tokens
        try:
            return self.runner.execute_model(scheduled)
        except EngineDeadError:
            raise  # no step can run any more: not a request's failure
        except Exception as exc:  # noqa: BLE001 (contained below, per request)
            if len(scheduled) == 1:
                failures.errors[next(iter(scheduled))] = _describe(exc)
                return ModelRunnerOutput([], [])
            logger.warning("a step of %d requests failed (%s); running them one at a time",
                           len(scheduled), _describe(exc))
        parts: list[ModelRunnerOutput] = []
        for req_id, num_tokens in scheduled.items():
            try:
                parts.append(self.runner.execute_model({req_id: num_tokens}))
            except EngineDeadError:
                raise
            except Exception as exc:  # noqa: BLE001
                logger.exception("request %s failed inside a step", req_id)
                failures.errors[req_id] = _describe(exc)
        return merge_runner_outputs(parts)


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


def start_executor(config: EngineConfig, device: torch.device):
    # Checks that the heads divide before any process starts, then starts ranks 1..N-1.
    from pagedserve.distributed.executor import MultiprocExecutor
    from pagedserve.distributed.parallel_state import check_divisible
    from pagedserve.model.loader import read_config, resolve_model_dir

    check_divisible(read_config(resolve_model_dir(config.model.model)[0]), config.parallel.tensor_parallel_size)
    return MultiprocExecutor(config, device)


def merge_runner_outputs(parts: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    merged = ModelRunnerOutput([], [])
    want_logprobs = any(p.logprobs is not None for p in parts)
    if want_logprobs:
        merged.logprobs, merged.top_logprobs, merged.ranks = [], [], []
    for p in parts:
        merged.req_ids += p.req_ids
        merged.sampled_token_ids += p.sampled_token_ids
        if want_logprobs:
            # A part without logprobs holds only requests that did not ask for them; placeholders keep rows aligned.
            n = len(p.req_ids)
            merged.logprobs += p.logprobs if p.logprobs is not None else [0.0] * n
            merged.top_logprobs += p.top_logprobs if p.top_logprobs is not None else [[] for _ in range(n)]
            merged.ranks += p.ranks if p.ranks is not None else [None] * n
        if p.prompt_logprobs:
            merged.prompt_logprobs = {**(merged.prompt_logprobs or {}), **p.prompt_logprobs}
    merged.spec = SpecDecodeOutput.merge([(len(p.req_ids), p.spec) for p in parts])
    drafts = [p.draft_token_ids for p in parts if p.draft_token_ids is not None]
    if drafts:
        merged.draft_token_ids = {r: d for part in drafts for r, d in part.items()}
    return merged


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
