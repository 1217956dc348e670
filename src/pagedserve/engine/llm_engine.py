"""The step loop: schedule -> run the model -> update requests -> detokenize -> RequestOutputs."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput, PromptLogprobsChunk
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.logprobs import TokenTexts, extend_prompt_logprobs, logprob_entry
from pagedserve.core.request import Request, RequestStatus
from pagedserve.engine.processor import Processor, PromptInput
from pagedserve.metrics.stats import EngineStats, RequestStats
from pagedserve.model.loader import load_model
from pagedserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.kv_cache import allocate_host_caches, allocate_kv_caches, kv_bytes_per_block
from pagedserve.worker.memory import plan_num_blocks
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sequence:
    # Engine-side state of one sample: its text and logprobs; tokens live in the Request.
    request: Request
    group_id: str
    index: int
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass(slots=True)
class _Group:
    # One user request: n samples sharing a prompt.
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence] = field(default_factory=list)
    # best_of > n: the best n samples by cumulative logprob are returned once all have finished.
    num_returned: int | None = None
    keep_logprobs: bool = True
    # Per request, not per sample: only the first sample computes them (see _child_params); [None] + one
    # entry per prompt token once its prefill is done.
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.status.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device = torch.device(config.device.resolve())
        if config.device.num_threads:
            torch.set_num_threads(config.device.num_threads)
        dtype = getattr(torch, config.model.dtype)
        t0 = time.perf_counter()
        loaded = load_model(config.model.model, device, dtype, config.model.attention_backend)
        self.model_name = loaded.model_name
        self.tokenizer = loaded.tokenizer
        self.token_texts = TokenTexts(loaded.tokenizer)
        self.hf_config = loaded.hf_config
        max_len = config.model.max_model_len or loaded.max_model_len
        if max_len > loaded.max_model_len:
            raise ValueError(f"max_model_len {max_len} exceeds the model's context length "
                             f"{loaded.max_model_len}")
        self.max_model_len = max_len
        self.processor = Processor(loaded, config.model, max_len)

        hf = loaded.hf_config
        num_kv_heads = hf.num_key_value_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        bs = config.cache.block_size
        num_blocks = plan_num_blocks(config.cache, hf.num_hidden_layers, num_kv_heads, head_dim, dtype, device)
        kv_caches = allocate_kv_caches(hf.num_hidden_layers, num_blocks, bs, num_kv_heads, head_dim, dtype,
                                       device)
        per_block = kv_bytes_per_block(hf.num_hidden_layers, bs, num_kv_heads, head_dim, dtype)
        num_host_blocks = int(config.cache.swap_space_gib * (1 << 30)) // per_block
        if config.cache.preemption_mode == "swap" and num_host_blocks == 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of host memory)")
        self.kv = KVCacheManager(num_blocks, bs, config.cache.enable_prefix_caching, num_host_blocks)
        self.scheduler = Scheduler(config.scheduler, self.kv, max_len, config.cache.preemption_mode)
        self.runner = ModelRunner(loaded.model, kv_caches, bs, hf.vocab_size, device,
                                  config.scheduler.max_num_seqs, max_len, config.model.seed)
        if num_host_blocks:
            self.runner.host_caches = allocate_host_caches(hf.num_hidden_layers, num_host_blocks, bs,
                                                           num_kv_heads, head_dim, dtype, device)
        self.stats = EngineStats()
        self.groups: dict[str, _Group] = {}
        self.seqs: dict[str, _Sequence] = {}
        self._next_id = 0
        logger.info("loaded %s in %.1fs on %s; KV pool: %d blocks x %d tokens = %d tokens",
                    self.model_name, time.perf_counter() - t0, device, num_blocks, bs, num_blocks * bs)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    def next_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self.processor.tokenize(prompt)
        max_tokens = self.processor.resolve_max_tokens(prompt_ids, params)
        self.processor.check_token_ids(params)
        group = _Group(request_id, prompt_text, prompt_ids)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # nothing predicts the first prompt token
        num_samples = params.best_of or params.n
        if num_samples > params.n:
            # Ranking needs each sample's cumulative logprob, so the sampler must report logprobs.
            group.num_returned, group.keep_logprobs = params.n, params.logprobs is not None
            params = dataclasses.replace(params, logprobs=params.logprobs or 0)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        for i in range(num_samples):
            # Sample i of a seeded request uses seed + i, so n=4 equals four requests seeded s..s+3.
            p = params if num_samples == 1 else _child_params(params, i)
            seq_id = request_id if num_samples == 1 else f"{request_id}#{i}"
            req = Request(seq_id, prompt_ids, p, max_tokens, self.processor.eos_token_ids(p), arrival)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, p)
            group.seqs.append(_Sequence(req, request_id, i, detok, [] if p.logprobs is not None else None))
        first = group.seqs[0].request
        for seq in group.seqs:
            # Samples after the first fork it: they share its prompt blocks instead of prefilling again.
            self.scheduler.add_request(seq.request, fork_of=None if seq.index == 0 else first)
            self.seqs[seq.request.req_id] = seq
        self.groups[request_id] = group

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for rid in ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            for seq in group.seqs:
                self.scheduler.finish_request(seq.request.req_id, RequestStatus.FINISHED_ABORTED)
                self.seqs.pop(seq.request.req_id, None)
            self.stats.num_aborted += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        t0 = time.perf_counter()
        result = self.runner.execute(plan)
        updated = self.scheduler.update(plan, result)
        now = time.monotonic()
        self._record_logprobs(result)
        if result.prompt_logprobs:
            self._record_prompt_logprobs(result.prompt_logprobs)
        touched: dict[str, _Group] = {}
        for req in updated:
            seq = self.seqs[req.req_id]
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            # Finished-stopped here means eos or a stop token id; its text is left out as in vLLM.
            by_token = req.status is RequestStatus.FINISHED_STOPPED
            stop = seq.detok.update(req.output_token_ids[-1:], stop_terminated=by_token)
            if stop is not None and not req.status.is_finished:
                req.stop_reason = stop
                self.scheduler.finish_request(req.req_id, RequestStatus.FINISHED_STOPPED)
            elif stop is not None:
                req.stop_reason = stop
            group = self.groups[seq.group_id]
            touched[group.request_id] = group
        for new_req in plan.scheduled_new_reqs:
            if (seq := self.seqs.get(new_req.req_id)) is not None and seq.request.scheduled_time is None:
                seq.request.scheduled_time = now
        self.stats.record_step(plan, self.scheduler.stats(), time.perf_counter() - t0)
        outputs = []
        for group in touched.values():
            out = self._make_output(group)
            if out.finished:
                self._retire(group)
            outputs.append(out)
        return outputs

    def _record_logprobs(self, result: ModelRunnerOutput) -> None:
        if result.logprobs is None or result.top_logprobs is None:
            return
        for j, req_id in enumerate(result.req_ids):
            seq = self.seqs.get(req_id)
            if seq is None or seq.logprobs is None:
                continue
            rank = result.ranks[j] if result.ranks is not None else None
            seq.logprobs.append(logprob_entry(self.token_texts, result.sampled_token_ids[j], result.logprobs[j],
                                              rank, result.top_logprobs[j]))

    def _record_prompt_logprobs(self, chunks: dict[str, PromptLogprobsChunk]) -> None:
        for req_id, chunk in chunks.items():
            seq = self.seqs.get(req_id)
            group = self.groups.get(seq.group_id) if seq is not None else None
            if group is not None and group.prompt_logprobs is not None:
                extend_prompt_logprobs(group.prompt_logprobs, chunk, self.token_texts)

    def _make_output(self, group: _Group) -> RequestOutput:
        completions = []
        for seq in group.seqs:
            req = seq.request
            done = req.status.is_finished
            completions.append(CompletionOutput(
                index=seq.index,
                text=seq.detok.get_next_output_text(done, delta=False),
                token_ids=list(req.output_token_ids),
                cumulative_logprob=req.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=seq.logprobs,
                finish_reason=req.status.value if done else None,
                stop_reason=req.stop_reason))
        if group.num_returned is not None:
            completions = _best_of(completions, group) if group.finished else []
        first = group.seqs[0].request
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             group.finished, prompt_logprobs=group.prompt_logprobs,
                             num_cached_tokens=first.num_cached_tokens,
                             metrics=RequestStats.from_request(first))

    def _retire(self, group: _Group) -> None:
        self.groups.pop(group.request_id, None)
        for seq in group.seqs:
            self.seqs.pop(seq.request.req_id, None)
            self.stats.record_finished(seq.request)


def _best_of(completions: list[CompletionOutput], group: _Group) -> list[CompletionOutput]:
    best = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)[:group.num_returned]
    for i, c in enumerate(best):
        c.index = i
        if not group.keep_logprobs:
            c.logprobs = c.cumulative_logprob = None
    return best


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else params.seed + index
    # Prompt logprobs belong to the request: the first sample computes them, the others fork its prompt
    # blocks (or, failing that, may take prefix-cache hits) and need not score the prompt again.
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, best_of=None, seed=seed, prompt_logprobs=prompt_logprobs)
