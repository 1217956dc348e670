"""The offline API, as vLLM's: `LLM(...).generate(prompts, SamplingParams(...))` and `.chat(messages)`."""
from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

from tqdm.auto import tqdm

from pagedserve.config import OFFLINE_BATCHED_TOKENS
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine, RequestFailedError
from pagedserve.engine.processor import PromptInput
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        # kwargs are EngineArgs fields; an unknown one is a TypeError naming it. With chunked prefill the default
        # token budget is the offline one, fixed (config.OFFLINE_BATCHED_TOKENS); without, the engine sizes it.
        if kwargs.get("enable_chunked_prefill", True) and kwargs.get("max_num_batched_tokens") is None:
            kwargs["max_num_batched_tokens"] = OFFLINE_BATCHED_TOKENS
            kwargs.setdefault("min_num_batched_tokens", OFFLINE_BATCHED_TOKENS)
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs).create_engine_config())
        self._thread_id = threading.get_ident()
        self._warned_thread = False

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        # priority (vLLM's): one per prompt, lower first; needs scheduling_policy="priority".
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        engine = self.llm_engine
        ids = [engine.next_request_id() for _ in prompts]
        try:
            engine.add_requests(list(zip(ids, prompts, params_list)), priority=0 if priority is None else priority)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, **template_kwargs: Any) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        proc = self.llm_engine.processor
        prompts = [proc.chat_prompt(conv, chat_template, add_generation_prompt, **template_kwargs)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams):
        from pagedserve.beam_search import run_beam_search

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return run_beam_search(self, list(prompts), params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        if threading.get_ident() != self._thread_id and not self._warned_thread:
            # On CPU a second thread gets its own OpenMP team; libgomp then throttles spin-waiting for both and
            # decode runs about 2x slower (benchmarks/HISTORY.md, "Threading fix").
            self._warned_thread = True
            logger.warning("LLM.generate runs on a different thread than the one that built the LLM; on CPU "
                           "this can halve decode speed. Build the LLM on the thread that generates.")
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
                failed = {rid: msg for rid, msg in engine.take_failures().items() if rid in wanted}
                if failed:
                    raise RequestFailedError("; ".join(f"request {rid} failed: {msg}" for rid, msg in failed.items()))
                if not engine.has_unfinished_requests() and len(done) < len(ids):
                    raise RuntimeError("the engine stopped with requests unfinished")
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]
