"""Urgent steps: under the priority policy a step makes room between its model layers for more urgent requests.

The front-end (engine/async_engine.py) sets a flag when it queues added requests (EngineCore.arrivals.pending);
the model reads it between its layers (model/layers/decoder_stack.py: inside the compiled loop, so a step no
one interrupts costs nothing) and, when it is set, stops there and calls this step's UrgentSteps. That takes in
the requests that arrived since the step started, and when the most urgent waiting request outranks every
request of the step, runs a step of such requests right there (Scheduler.schedule_urgent, then the core's
usual run of a plan) and sends their outputs on at once; then the step goes on from the next layer, its own
inputs and K/V untouched. An urgent prompt's first token then waits for one layer of a long low-priority
prefill instead of all of it, and in a decode step it runs alone at once instead of after the step, beside its
decodes (docs/scheduling.md).

Not with tensor parallelism (every rank would have to run the same step at the same layer) nor with speculative
decoding (a plan's drafts are the worker's state for its step); offline every request is added before the
first step, so there is nothing to take in.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pagedserve.core.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class UrgentSteps:
    """The urgent steps run inside one step (in_flight): model/layers/decoder_stack.py's BetweenLayers."""

    def __init__(self, core: Any, in_flight: SchedulerOutput) -> None:  # core: engine/core.py's EngineCore
        self.core = core
        self.in_flight = in_flight
        self.flag = torch.frombuffer(core.arrivals.pending, dtype=torch.int64)  # the front-end's memory
        self.seconds = 0.0  # spent in urgent steps: not the step's own time
        self.error: Exception | None = None  # a failure outside any request, raised once the step is back
        self.done = False  # no more in this step: one found no room to run, or failed

    @classmethod
    def for_step(cls, core: Any, plan: SchedulerOutput) -> UrgentSteps | None:
        if (core.arrivals is None or not core.scheduler.policy.preempts_for_waiting
                or core.config.speculative is not None or not core.executor.runs_between_layers):
            return None
        return cls(core, plan)

    def __call__(self) -> None:
        core = self.core
        t0 = time.perf_counter()
        try:
            core.arrivals.take()  # clears the flag
            if self.done:
                return
            plan = core.scheduler.schedule_urgent(self.in_flight)
            if plan is None:
                return
            if not plan.num_scheduled_tokens:  # no room (blocks): not again in this step
                self.done = True
                if plan.is_empty:
                    return
            outputs = core.run_plan(plan)
            if outputs:
                core.arrivals.emit(outputs)
        except Exception as exc:  # noqa: BLE001 (raised when the step is back: EngineCore.run_plan)
            logger.exception("an urgent step failed")
            self.error, self.done = exc, True
        finally:
            self.seconds += time.perf_counter() - t0

    def end(self) -> float:
        """After the step's forward pass: the seconds urgent steps took, or what failed in one."""
        if self.error is not None:
            raise self.error
        return self.seconds
