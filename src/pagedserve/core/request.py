"""Token bookkeeping for one sequence. No tensors: the scheduler and engine share this record."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                  # resolved against max_model_len
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    # Tenant key for the prefix cache: only requests with the same salt (or both None) share blocks.
    cache_salt: str | None = None
    # Scheduling (core/waiting_queue.py, core/scheduling_policy.py): lower priority values are served first
    # under --scheduling-policy priority; sequences of one client request share a fairness group.
    priority: int = 0
    client_request_id: str | None = None
    queue_key: tuple[int, int] | None = None   # set when it first waits: (policy key, arrival order)
    admitted_step: int | None = None           # the scheduler step that last admitted it
    # longrope models: the K/V is (to be) computed with the long factors; set by the scheduler, which
    # recomputes a request whose length passes the switch (core/scheduler.py). Part of the prefix-cache key.
    long_rope: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V is in the cache. Prefill, chunked prefill, prefix hits and recompute after
    # preemption all just move this towards num_tokens.
    num_computed_tokens: int = 0
    # Speculative decoding: draft tokens proposed after the last step, verified in the next one. They are
    # never part of all_token_ids; the scheduler schedules them after the last token (1 + k query tokens).
    spec_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0       # prompt tokens served by the prefix cache on first schedule
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    cumulative_logprob: float = 0.0
    # Timestamps for metrics (monotonic seconds).
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def skip_prefix_cache_reads(self) -> bool:
        # Prompt logprobs need the logits of every prompt position; a prefix-cache hit would skip computing
        # the cached ones (vLLM makes the same choice). Such a request still fills the cache for others.
        return self.params.prompt_logprobs is not None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        # Stop strings need text and are checked by the detokenizer in the engine.
        n_out = len(self.output_token_ids)
        if n_out == 0:
            return None
        last = self.output_token_ids[-1]
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if self.params.stop_token_ids and last in self.params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
