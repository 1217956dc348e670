"""What crosses between the layers, as plain typed records: no torch, no engine code.

    front-end (engine/processor.py)  --EngineCoreRequest-->   engine core (engine/core.py)
    front-end (engine/async_engine.py) --AddRequests, FinishRequests, TakeKVSnapshot, AddFinishedHook, ClearWarmup-->
                                        the engine thread, which calls the core's method of the same name
    front-end (engine/output_processor.py) <--EngineCoreOutput--  engine core
    engine core --Arrivals.take(), .emit(outputs)--> front-end, between the layers of a step (urgent steps)
    engine core --SchedulerOutput (core/scheduler_output.py)--> executor -> workers
    engine core <--ModelRunnerOutput (core/scheduler_output.py)-- executor

and the errors each side raises to the other. The server and the front-end import these instead of the
engine core, so neither pulls in torch, the loader or distributed/ for a message type.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pagedserve.core.request import RequestStatus
from pagedserve.core.scheduler_output import ModelRunnerOutput, PromptLogprobsChunk
from pagedserve.metrics.stats import RequestStats
from pagedserve.sampling_params import SamplingParams

__all__ = ["EngineCoreRequest", "EngineCoreOutput", "SampledLogprobs", "ModelRunnerOutput", "PromptLogprobsChunk",
           "AddRequests", "FinishRequests", "TakeKVSnapshot", "AddFinishedHook", "ClearWarmup", "EngineCommand",
           "Arrivals",
           "EngineError", "RequestConstraintError", "EngineClosedError", "EngineDeadError"]


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


# What the front-end asks of the engine thread (vLLM's EngineCoreRequestType ADD / ABORT / UTILITY): each runs
# between two steps, in the order sent.
@dataclass(frozen=True, slots=True)
class AddRequests:
    requests: list[EngineCoreRequest]  # one client request's sequences: all are added or none


@dataclass(frozen=True, slots=True)
class FinishRequests:
    req_ids: list[str]  # aborted (client gone) or stopped by a stop string the front-end found
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


@dataclass(frozen=True, slots=True)
class TakeKVSnapshot:
    pass  # answered with the KV pool's state (core/kv_snapshot.py) and the engine's counters


@dataclass(frozen=True, slots=True)
class AddFinishedHook:
    hook: Callable[[RequestStats], None]  # called on the engine thread with each finished sequence's stats


@dataclass(frozen=True, slots=True)
class ClearWarmup:
    pass  # forget the start-up warm-up's blocks and counts (engine/warmup.py)


EngineCommand = AddRequests | FinishRequests | TakeKVSnapshot | AddFinishedHook | ClearWarmup


@dataclass(frozen=True, slots=True)
class Arrivals:
    # The front-end's side of urgent steps (engine/urgent_steps.py). pending: 8 bytes, a little-endian int64 the
    # front-end sets to 1 when it queues added requests, which the model reads between its layers (no lock: a
    # stale 1 costs one needless stop). Then, on the engine thread inside the step: take() clears it and adds
    # the requests that arrived since the step started, emit() sends an urgent step's outputs on before the
    # step ends.
    take: Callable[[], None]
    emit: Callable[[list[EngineCoreOutput]], None]
    pending: bytearray


def describe_error(exc: BaseException) -> str:
    # How a failure reads in a request's error, a log line or another rank's answer: "ValueError: message".
    return f"{type(exc).__name__}: {exc}"


class EngineError(RuntimeError):
    """A request failed inside the engine; the engine itself keeps serving."""


class RequestConstraintError(ValueError):
    """A request's own parameters left nothing to sample (e.g. a grammar that must end, and min_tokens that
    forbids ending): its fault, not the engine's, so the server answers 400."""

    # How the engine core begins such a failure's message; the front end raises this class for it.
    PREFIX = "no token satisfies both the structured output constraint and the other sampling parameters"


class EngineClosedError(RuntimeError):
    """The engine was shut down."""


class EngineDeadError(EngineClosedError):
    """The engine cannot run another step (a tensor-parallel rank died or stopped answering); it is closed."""
