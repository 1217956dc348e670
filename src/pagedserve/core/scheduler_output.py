"""Plans from the scheduler to the model runner, and the runner's plain-Python answer. No tensors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.core.kv_disk import KVOffloadStats
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, slots=True)
class NewRequestData:
    # A request the worker has not seen: everything it needs to keep the request's state from now on.
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]          # the whole block table after this step's allocation
    num_computed_tokens: int      # tokens whose K/V is already in the cache (prefix hits, a fork's share)


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    # Requests the worker already holds, as the difference since the plan that last scheduled them; one
    # entry per request in each list (vLLM's layout).
    req_ids: list[str] = field(default_factory=list)
    # True when the request comes back from preemption: the worker dropped its block table then, so
    # new_block_ids is the whole table; otherwise new_block_ids is appended to the worker's table.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # tokens appended since (sampled ones)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(frozen=True, slots=True)
class GrammarOutput:
    # The tokens each request under a grammar may sample this step (vLLM's GrammarOutput), filled by the
    # engine core's matchers: bit t % 32 of bitmask[i, t // 32] is set when req_ids[i] may sample token t.
    # Such requests get no drafts, so each has one row: the one of its last scheduled token.
    req_ids: list[str]
    bitmask: np.ndarray  # int32 [len(req_ids), ceil(vocab_size / 32)]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan. The worker keeps each request's state (tokens, block table, sampling params) from
    the first plan that schedules it until its id appears in finished_req_ids; plans carry only changes.

    Each scheduled request computes num_scheduled_tokens[req_id] tokens from its num_computed_tokens on,
    and samples a new token when that reaches its last known token. The dict's order is the batch order."""
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # The worker frees their batch rows but keeps their tokens and generator until they resume.
    preempted_req_ids: list[str] = field(default_factory=list)
    # Requests that left since the previous plan: the worker drops all their state.
    finished_req_ids: list[str] = field(default_factory=list)
    block_ops: BlockOps = field(default_factory=lambda: BlockOps([], [], []))
    # For metrics: prompt tokens computed this step (prefix hits excluded), and requests that sample.
    num_scheduled_prompt_tokens: int = 0
    num_sampling_reqs: int = 0
    # Speculative decoding: the draft tokens scheduled after each request's last token (its last
    # len(drafts) scheduled tokens). The worker verifies them and samples one token more.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Structured outputs: the step's token bitmask, added by the engine core after scheduling. The runner masks
    # the logits with it and never sees a grammar.
    grammar: GrammarOutput | None = None

    @property
    def is_empty(self) -> bool:
        # Nothing for the worker to do. A plan that schedules no token may still carry finished ids and
        # swap-outs, which the worker must apply.
        return not (self.num_scheduled_tokens or self.finished_req_ids or self.preempted_req_ids
                    or self.block_ops)


@dataclass(slots=True)
class PromptLogprobsChunk:
    # What one step computed for one request's prompt logprobs: the logits row at position p scores prompt
    # token p + 1, so a chunk over positions [s, e) scores prompt tokens first_index = s + 1 .. e (the row
    # at the last prompt position scores the first output token and belongs to the sampler instead).
    first_index: int
    token_ids: list[int]                          # the prompt tokens scored
    logprobs: list[float]                         # of each of them
    ranks: list[int]                              # 1-based rank of each of them
    top_logprobs: list[list[tuple[int, float]]]   # per token, (token id, logprob) most likely first


@dataclass(slots=True)
class ModelRunnerOutput:
    # One entry per scheduled request that reaches its last token, in batch order.
    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[float] | None = None                      # of each sampled token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per request, [] when not asked
    ranks: list[int] | None = None                           # rank of each sampled token
    # Only requests with SamplingParams.prompt_logprobs whose step covered prompt positions; None when none.
    prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None
    # Speculative decoding; None when no request in the step had drafts.
    spec: SpecDecodeOutput | None = None
    # Draft-model speculation: each sampled request's drafts for its next step; None without a draft model.
    draft_token_ids: dict[str, list[int]] | None = None

    @staticmethod
    def merge(parts: list[ModelRunnerOutput]) -> ModelRunnerOutput:
        # Outputs of the same plan's requests run apart (the engine core isolating a failing request),
        # concatenated row-wise.
        merged = ModelRunnerOutput([], [])
        want_logprobs = any(p.logprobs is not None for p in parts)
        if want_logprobs:
            merged.logprobs, merged.top_logprobs, merged.ranks = [], [], []
        for p in parts:
            merged.req_ids += p.req_ids
            merged.sampled_token_ids += p.sampled_token_ids
            if want_logprobs:
                # A part without logprobs holds only requests that did not ask for them; placeholders keep
                # the rows aligned.
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


@dataclass(slots=True)
class SpecDecodeOutput:
    # Per row of the ModelRunnerOutput: the draft tokens the request accepted, which come before its
    # sampled token (the recovered or bonus one), and how many drafts it verified.
    accepted_token_ids: list[list[int]]
    num_draft_tokens: list[int]
    # Of each accepted token, as the ModelRunnerOutput's own fields are of the sampled one; None when no row
    # asked for logprobs.
    logprobs: list[list[float]] | None = None
    ranks: list[list[int]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None

    @staticmethod
    def merge(parts: list[tuple[int, SpecDecodeOutput | None]]) -> SpecDecodeOutput | None:
        # (number of rows, spec output) of runner outputs concatenated row-wise; rows without drafts get
        # empty entries so every list stays aligned with the merged rows.
        if all(spec is None for _, spec in parts):
            return None
        with_logprobs = any(spec is not None and spec.logprobs is not None for _, spec in parts)
        merged = SpecDecodeOutput([], [], [] if with_logprobs else None, [] if with_logprobs else None,
                                  [] if with_logprobs else None)
        for n, spec in parts:
            merged.accepted_token_ids += spec.accepted_token_ids if spec else [[] for _ in range(n)]
            merged.num_draft_tokens += spec.num_draft_tokens if spec else [0] * n
            if with_logprobs:
                has = spec is not None and spec.logprobs is not None
                merged.logprobs += spec.logprobs if has else [[] for _ in range(n)]
                merged.ranks += spec.ranks if has else [[] for _ in range(n)]
                merged.top_logprobs += spec.top_logprobs if has else [[] for _ in range(n)]
        return merged


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_free_blocks: int
    num_blocks: int
    num_shared_blocks: int = 0
    num_cow_copies_total: int = 0
    num_swapped_out_blocks_total: int = 0
    num_swapped_in_blocks_total: int = 0
    num_preemptions_swap_total: int = 0
    num_swapped: int = 0
    kv_offload: KVOffloadStats | None = None  # a copy of the disk tier's counters; None without one
