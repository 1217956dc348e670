"""The front-end's output side: EngineCoreOutputs (token-id deltas) -> RequestOutputs.

Detokenization, stop strings, logprob formatting and best_of ranking happen here, on the caller's thread,
never on the engine thread. A stop string found here ends the sample in the front-end at once; the core is
told to free it (finish_requests), and any token it computed meanwhile is dropped.

Per-request failures stay per request: an error raised while processing one request's output fails that
request only (it is reported in `failures` and its samples are sent to the core to be aborted).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pagedserve.messages import EngineCoreOutput, describe_error
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.logprobs import TokenTexts, extend_prompt_logprobs, logprob_entry
from pagedserve.engine.processor import ProcessedRequest
from pagedserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedserve.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sample:
    index: int
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # DELTA: tokens the previous outputs carried
    sent_final: bool = False  # DELTA: the output with its finish_reason went out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _RequestState:
    processed: ProcessedRequest
    samples: dict[str, _Sample]   # by core req_id, in index order
    kind: RequestOutputKind
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: Any | None = None
    sent_prompt: bool = False

    @property
    def request_id(self) -> str:
        return self.processed.request_id

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples.values())


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Samples ended here (stop strings): the core should free them as finished-stopped.
    stopped_core_ids: list[str] = field(default_factory=list)
    # Requests that failed (inside a step or here), with the error; their samples go in aborted_core_ids.
    failures: dict[str, str] = field(default_factory=dict)
    aborted_core_ids: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.requests: dict[str, _RequestState] = {}
        self._owner: dict[str, _RequestState] = {}  # core req_id -> its request

    def add_request(self, processed: ProcessedRequest) -> None:
        if processed.request_id in self.requests:
            raise ValueError(f"request id {processed.request_id!r} is already in use")
        samples = {}
        for i, core_req in enumerate(processed.core_requests):
            p = core_req.params
            detok = IncrementalDetokenizer(self.tokenizer, processed.prompt_token_ids, p)
            samples[core_req.req_id] = _Sample(i, detok, [] if p.logprobs is not None else None)
        state = _RequestState(processed, samples, processed.params.output_kind)
        if processed.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # nothing predicts the first prompt token
        self.requests[processed.request_id] = state
        for core_id in samples:
            self._owner[core_id] = state

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget these requests; returns their core ids, which the caller aborts in the core."""
        core_ids = []
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                core_ids += self._forget(state)
        return core_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        touched: dict[str, _RequestState] = {}
        for out in core_outputs:
            state = self._owner.get(out.req_id)
            if state is None:
                continue  # aborted or failed meanwhile
            try:
                if out.error is not None:
                    raise RuntimeError(out.error)
                if self._apply(state, out, result):
                    touched[state.request_id] = state
            except Exception as exc:  # noqa: BLE001 (this request fails, the others go on)
                logger.exception("output processing failed for request %s", state.request_id)
                self._fail(state, describe_error(exc) if out.error is None else out.error, result)
                touched.pop(state.request_id, None)
        for state in touched.values():
            try:
                out = self._make_output(state)
            except Exception as exc:  # noqa: BLE001
                logger.exception("output processing failed for request %s", state.request_id)
                self._fail(state, describe_error(exc), result)
                continue
            if state.finished:
                self.requests.pop(state.request_id, None)
                self._forget(state)
            if out is not None:
                result.request_outputs.append(out)
        return result

    def _apply(self, state: _RequestState, out: EngineCoreOutput, result: ProcessedOutputs) -> bool:
        # True when a sample moved (new tokens or finished), so the request has an output to give.
        sample = state.samples[out.req_id]
        if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
            extend_prompt_logprobs(state.prompt_logprobs, out.prompt_logprobs, self.token_texts)
        if sample.index == 0:
            state.num_cached_tokens = out.num_cached_tokens
            state.metrics = out.stats
        if sample.finished or not (out.new_token_ids or out.finished):
            return False
        # Finished-stopped by the core means eos or a stop token id; its text is left out as in vLLM.
        by_token = out.finish_reason == "stop"
        new_ids = out.new_token_ids
        finish_reason = out.finish_reason
        cumulative = out.cumulative_logprob
        stop = None
        # Token by token: with speculative decoding a step brings several, and a stop string ends the
        # output at the token that completes it, exactly as without speculation.
        for i, token_id in enumerate(new_ids):
            last = i == len(new_ids) - 1
            stop = sample.detok.update([token_id], stop_terminated=by_token and last)
            if stop is not None and not last:
                new_ids = new_ids[:i + 1]
                if finish_reason is not None:
                    finish_reason = "stop"  # the stop string came first
                if out.new_logprobs is not None:
                    cumulative -= sum(out.new_logprobs.logprobs[i + 1:])
                break
        sample.token_ids += new_ids
        sample.cumulative_logprob = cumulative
        if sample.logprobs is not None and out.new_logprobs is not None:
            lp = out.new_logprobs
            for k, token_id in enumerate(new_ids):
                sample.logprobs.append(logprob_entry(self.token_texts, token_id, lp.logprobs[k], lp.ranks[k],
                                                     lp.top[k]))
        if finish_reason is not None:
            sample.finish_reason = finish_reason
            sample.stop_reason = stop if stop is not None else out.stop_reason
        elif stop is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop
            result.stopped_core_ids.append(out.req_id)
        return True

    def _fail(self, state: _RequestState, message: str, result: ProcessedOutputs) -> None:
        self.requests.pop(state.request_id, None)
        result.failures[state.request_id] = message
        result.aborted_core_ids += [cid for cid, s in state.samples.items() if not s.finished]
        self._forget(state)

    def _forget(self, state: _RequestState) -> list[str]:
        for core_id in state.samples:
            self._owner.pop(core_id, None)
        return [cid for cid, s in state.samples.items() if not s.finished]

    def _make_output(self, state: _RequestState) -> RequestOutput | None:
        finished = state.finished
        processed = state.processed
        if ((state.kind is RequestOutputKind.FINAL_ONLY or processed.num_returned is not None)
                and not finished):
            return None
        delta = state.kind is RequestOutputKind.DELTA
        completions = []
        for s in state.samples.values():
            start = s.num_sent_tokens if delta else 0
            if delta and start == len(s.token_ids) and (s.sent_final or not s.finished):
                continue  # nothing new for this sample
            completions.append(CompletionOutput(
                index=s.index, text=s.detok.get_next_output_text(s.finished, delta=delta),
                token_ids=s.token_ids[start:],
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=s.logprobs[start:len(s.token_ids)] if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
            s.num_sent_tokens = len(s.token_ids)
            s.sent_final = s.finished
        if processed.num_returned is not None:
            completions = _best_of(completions, processed.num_returned, processed.keep_logprobs)
        if delta and not completions:
            return None
        # DELTA: the prompt's logprobs travel once, with the first output (they are complete by then: the
        # first token is sampled after the whole prompt is computed).
        prompt_logprobs = None if delta and state.sent_prompt else state.prompt_logprobs
        state.sent_prompt = True
        return RequestOutput(processed.request_id, processed.prompt, processed.prompt_token_ids, completions,
                             finished, prompt_logprobs=prompt_logprobs, num_cached_tokens=state.num_cached_tokens,
                             metrics=state.metrics)


def _best_of(completions: list[CompletionOutput], n: int, keep_logprobs: bool) -> list[CompletionOutput]:
    best = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
    for i, c in enumerate(best):
        c.index = i
        if not keep_logprobs:
            c.logprobs = c.cumulative_logprob = None
    return best
