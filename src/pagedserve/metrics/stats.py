"""Plain records of what the engine did. Exporters (Prometheus) read these; nothing here imports them."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from pagedserve.core.scheduler_output import SchedulerOutput, SchedulerStats


@dataclass(frozen=True, slots=True)
class RequestStats:
    arrival_time: float
    scheduled_time: float | None    # first admitted by the scheduler
    first_token_time: float | None
    last_token_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int      # over all samples
    num_cached_tokens: int
    finish_reason: str | None
    num_samples: int = 1            # n (or best_of) samples generated side by side
    priority: int = 0

    @classmethod
    def from_request(cls, req) -> "RequestStats":
        done = req.status.is_finished
        return cls(req.arrival_time, req.scheduled_time, req.first_token_time, req.last_token_time,
                   req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens,
                   req.status.value if done else None, priority=req.priority)

    @classmethod
    def from_samples(cls, reqs: list) -> "RequestStats":
        # One user request of n samples, as vLLM counts it: queued until its first sample was scheduled,
        # first token from the earliest sample, done with the last; its finish reason is sample 0's.
        first = reqs[0]
        if len(reqs) == 1:
            return cls.from_request(first)

        def earliest(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return min(known) if known else None

        last_times = [r.last_token_time for r in reqs if r.last_token_time is not None]
        return cls(first.arrival_time, earliest([r.scheduled_time for r in reqs]),
                   earliest([r.first_token_time for r in reqs]), max(last_times) if last_times else None,
                   first.num_prompt_tokens, sum(r.num_output_tokens for r in reqs), first.num_cached_tokens,
                   first.status.value if first.status.is_finished else None, len(reqs), first.priority)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.last_token_time is None else self.last_token_time - self.arrival_time

    @property
    def num_token_gaps(self) -> int:
        # Each sample's tokens after its first one (samples decode side by side, not one after another).
        return max(0, self.num_generation_tokens - self.num_samples)

    @property
    def mean_inter_token_latency(self) -> float | None:
        if self.num_token_gaps < 1 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) * self.num_samples / self.num_token_gaps


@dataclass(slots=True)
class SpecDecodingStats:
    # vLLM's spec_decode_* counters. A draft is one request's drafts verified in one step.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def record(self, spec) -> None:
        # spec: a SpecDecodeOutput (one step's verified drafts).
        per_pos = self.num_accepted_tokens_per_pos
        for accepted, num_drafts in zip(spec.accepted_token_ids, spec.num_draft_tokens):
            if not num_drafts:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += len(accepted)
            if len(per_pos) < num_drafts:
                per_pos.extend([0] * (num_drafts - len(per_pos)))
            for i in range(len(accepted)):
                per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        # Tokens emitted per verifying step: the accepted drafts plus the one sampled token.
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass(slots=True)
class EngineStats:
    num_prompt_tokens_total: int = 0       # prompt tokens computed (prefix hits excluded)
    num_generation_tokens_total: int = 0
    num_steps: int = 0
    step_time_total: float = 0.0
    # Both counted per user request: n samples are one request, finished or aborted.
    num_aborted: int = 0
    finished_by_reason: Counter = field(default_factory=Counter)
    scheduler: SchedulerStats | None = None
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    # Exporters subscribe here; called with each finished request's stats.
    on_finished: list[Callable[[RequestStats], None]] = field(default_factory=list)

    def record_step(self, plan: SchedulerOutput, sched: SchedulerStats, step_time: float,
                    num_generated: int | None = None) -> None:
        # num_generated: tokens the step emitted (with speculation, several per request); default one per
        # sampling request.
        self.num_steps += 1
        self.step_time_total += step_time
        self.scheduler = sched
        self.num_prompt_tokens_total += plan.num_scheduled_prompt_tokens
        self.num_generation_tokens_total += plan.num_sampling_reqs if num_generated is None else num_generated

    def record_finished(self, samples: list) -> None:
        # samples: the finished Requests of one user request.
        rs = RequestStats.from_samples(samples)
        self.finished_by_reason[rs.finish_reason] += 1
        for fn in self.on_finished:
            fn(rs)
