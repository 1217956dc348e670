"""The synchronous engine: Processor -> EngineCore -> OutputProcessor, all on the caller's thread.

    add_request(prompt, params) -> Processor.process -> EngineCore.add_requests
    step() -> EngineCore.step -> OutputProcessor.process_outputs -> RequestOutputs
"""
from __future__ import annotations

import logging
import weakref
from typing import Sequence

from pagedserve.config import EngineConfig
from pagedserve.core.request import RequestStatus
from pagedserve.engine.core import EngineCore
from pagedserve.engine.output_processor import OutputProcessor, ProcessedOutputs
from pagedserve.engine.processor import Processor, PromptInput
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """A request failed inside the engine; the other requests were not affected."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.config = config = self.core.config  # with the limits resolved against the model and the pool
        loaded = self.core.loaded
        self.model_name = self.core.model_name
        self.hf_config = self.core.hf_config
        self.max_model_len = self.core.max_model_len
        self.tokenizer = loaded.tokenizer
        self.processor = Processor(loaded, config.model, self.max_model_len, config.structured_outputs,
                                   config.scheduler)
        # The grammar compile processes and threads end with this engine (the server's shuts them down itself).
        weakref.finalize(self, self.processor.grammars.shutdown)
        self.output_processor = OutputProcessor(loaded.tokenizer)
        self.token_texts = self.output_processor.token_texts
        # Requests that failed since the caller last looked (request id -> error); see take_failures().
        self.failures: dict[str, str] = {}
        self._next_id = 0

    # The core's parts, for tests and benchmarks that inspect them.
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.kv

    @property
    def runner(self):
        return self.core.runner

    @property
    def stats(self):
        return self.core.stats

    @property
    def num_kv_blocks(self) -> int:
        return self.core.num_kv_blocks

    def next_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.add_requests([(request_id, prompt, params)], arrival_time, priority)

    def add_requests(self, requests: list[tuple[str, PromptInput, SamplingParams]],
                     arrival_time: float | None = None, priority: int | Sequence[int] = 0) -> None:
        """Processes all first, so their grammars compile side by side, then adds them one by one; a request
        that fails validation raises after the ones before it were added (the caller aborts those).

        They are one client request (the scheduler is fair between client requests); priority is one for all
        or one per request."""
        priorities = [priority] * len(requests) if isinstance(priority, int) else list(priority)
        if len(priorities) != len(requests):
            raise ValueError(f"got {len(requests)} prompts but {len(priorities)} priorities")
        client_id = requests[0][0] if requests else None
        processed = []
        for (request_id, prompt, params), prio in zip(requests, priorities):
            if request_id in self.output_processor.requests or any(p.request_id == request_id for p in processed):
                raise ValueError(f"request id {request_id!r} is already in use")
            processed.append(self.processor.process(request_id, prompt, params, arrival_time, prio, client_id))
        for p in processed:
            if p.grammar_future is not None:
                p = p.with_grammar(self.processor.grammars.wait(p.grammar_future))
            self.core.add_requests(p.core_requests)
            self.output_processor.add_request(p)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.finish_requests(self.output_processor.abort_requests(ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def step(self) -> list[RequestOutput]:
        processed = self.output_processor.process_outputs(self.core.step())
        self.apply_front_end_decisions(processed)
        return processed.request_outputs

    def apply_front_end_decisions(self, processed: ProcessedOutputs) -> None:
        self.core.finish_requests(processed.stopped_core_ids, RequestStatus.FINISHED_STOPPED)
        self.core.finish_requests(processed.aborted_core_ids)
        self.failures.update(processed.failures)

    def take_failures(self) -> dict[str, str]:
        failures, self.failures = self.failures, {}
        return failures
