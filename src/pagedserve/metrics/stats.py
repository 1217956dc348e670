"""Plain records of what the engine did. Exporters (Prometheus) read these; nothing here imports them."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from pagedserve.core.scheduler_output import SchedulerOutput, SchedulerStats


@dataclass(frozen=True, slots=True)
class RequestStats:
    arrival_time: float
    scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    finish_reason: str | None

    @classmethod
    def from_request(cls, req) -> "RequestStats":
        done = req.status.is_finished
        return cls(req.arrival_time, req.scheduled_time, req.first_token_time, req.last_token_time,
                   req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens,
                   req.status.value if done else None)

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
    def mean_inter_token_latency(self) -> float | None:
        if self.num_generation_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass(slots=True)
class EngineStats:
    num_prompt_tokens_total: int = 0       # prompt tokens computed (prefix hits excluded)
    num_generation_tokens_total: int = 0
    num_steps: int = 0
    step_time_total: float = 0.0
    num_aborted: int = 0
    finished_by_reason: Counter = field(default_factory=Counter)
    scheduler: SchedulerStats | None = None
    # Exporters subscribe here; called with each finished request's stats.
    on_finished: list[Callable[[RequestStats], None]] = field(default_factory=list)

    def record_step(self, plan: SchedulerOutput, sched: SchedulerStats, step_time: float) -> None:
        self.num_steps += 1
        self.step_time_total += step_time
        self.scheduler = sched
        self.num_prompt_tokens_total += plan.num_scheduled_prompt_tokens
        self.num_generation_tokens_total += plan.num_sampling_reqs

    def record_finished(self, req) -> None:
        self.finished_by_reason[req.status.value] += 1
        if self.on_finished:
            rs = RequestStats.from_request(req)
            for fn in self.on_finished:
                fn(rs)
