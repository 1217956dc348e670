"""A model-free stand-in for LLMEngine: one token per step per request, in milliseconds."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from pagedserve.core.scheduler_output import SchedulerStats
from pagedserve.metrics.stats import EngineStats
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams


class FakeEngine:
    """One token per step per request; records which threads touch it."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.model_name, self.max_model_len, self.num_kv_blocks = "fake", 128, 8
        self.config = SimpleNamespace(cache=SimpleNamespace(block_size=16))
        self.stats = EngineStats()
        self.requests: dict[str, tuple[SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.threads: set[int] = set()
        self.fail_next_step = False
        self.step_s = step_s
        self.scheduler = SimpleNamespace(stats=self._sched_stats)
        self.stats_delay_s = 0.0  # how long a stats read (each snapshot) takes
        self.step_gate: threading.Event | None = None  # when set up, each step waits for it

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def _sched_stats(self) -> SchedulerStats:
        self._touch()
        time.sleep(self.stats_delay_s)
        used = len(self.requests)
        return SchedulerStats(used, 0, used / self.num_kv_blocks, 0, 0, 0, self.num_kv_blocks - used,
                              self.num_kv_blocks)

    def add_request(self, request_id, prompt, params) -> None:
        self._touch()
        if prompt == "too long":
            raise ValueError("the prompt is too long")
        if prompt == "crash":
            raise RuntimeError("a bug in the engine")
        if request_id in self.requests:
            raise ValueError("duplicate id")
        self.requests[request_id] = (params, [])

    def abort_request(self, ids) -> None:
        self._touch()
        for rid in [ids] if isinstance(ids, str) else ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._touch()
        time.sleep(self.step_s)
        if self.step_gate is not None:
            self.step_gate.wait()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs = []
        for rid, (params, tokens) in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= params.max_tokens
            text = "".join(f"t{t} " for t in tokens)
            comp = CompletionOutput(0, text, list(tokens), None, None, "length" if done else None)
            outs.append(RequestOutput(rid, None, [1], [comp], done))
            if done:
                del self.requests[rid]
                self.stats.finished_by_reason["length"] += 1
        return outs
