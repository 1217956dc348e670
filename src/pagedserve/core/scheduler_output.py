"""Plans from the scheduler to the model runner, and the runner's plain-Python answer. No tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.core.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request: Request        # read-only for the runner
    token_ids: list[int]    # tokens whose K/V this step computes
    start_pos: int          # position of token_ids[0] (= num_computed_tokens before the step)
    block_ids: list[int]    # the whole block table after this step's allocation
    sample: bool            # True when this step reaches the last token, so a new token is sampled


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_req_ids: list[str] = field(default_factory=list)
    # Requests that left since the previous plan, so the runner can drop per-request state.
    finished_req_ids: list[str] = field(default_factory=list)
    block_ops: BlockOps = field(default_factory=lambda: BlockOps([], [], []))

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


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
    # One entry per scheduled request with sample=True, in plan order.
    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[float] | None = None                      # of each sampled token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per request, [] when not asked
    ranks: list[int] | None = None                           # rank of each sampled token
    # Only requests with SamplingParams.prompt_logprobs whose step covered prompt positions; None when none.
    prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None


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
