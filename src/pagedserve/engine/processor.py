"""The front-end's input side: prompts and chat messages -> validated EngineCoreRequests.

Runs on the caller's thread (offline) or a tokenizer thread (server), never on the engine thread, so a huge
prompt costs its own request time, not everyone's step time. Every check that can fail for one request runs
here, before anything reaches the engine core.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

from pagedserve.config import ModelConfig, SchedulerConfig, StructuredOutputsConfig
from pagedserve.messages import EngineCoreRequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.backend import GrammarCompileService, check_first_token

# The tool-calling chat template shipped for the embedded SmolLM2 (its own template has no tools).
EMBEDDED_CHAT_TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "chat_templates",
                                      "smollm2_tool_use.jinja")

@dataclass(frozen=True, slots=True)
class ChatPrompt:
    # A conversation, rendered with the chat template on the tokenizer thread (Processor.render_chat); the
    # same steps as LLM.chat, so a greedy chat request served answers exactly as offline.
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    chat_template: str | None = None  # None: the model's (or --chat-template)
    template_kwargs: dict[str, Any] | None = None  # tools, documents, chat_template_kwargs
    cache_salt: str | None = None


# A prompt is text, a list of token ids, vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": ...}, or a
# ChatPrompt.
PromptInput = str | list[int] | dict[str, Any] | ChatPrompt


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams                # as the user gave them
    core_requests: list[EngineCoreRequest]  # one per sample; best_of > n makes best_of of them
    num_returned: int | None              # best_of > n: keep the best n once all finish
    keep_logprobs: bool                   # False when logprobs were turned on only to rank best_of samples
    # Structured outputs: the grammar compiling off the engine thread. The caller waits for it (with the
    # compile timeout) and attaches it with with_grammar before adding core_requests to the engine.
    grammar_future: concurrent.futures.Future | None = None

    def with_grammar(self, grammar: Any) -> ProcessedRequest:
        check_first_token(grammar, self.params)
        reqs = [dataclasses.replace(r, grammar=grammar) for r in self.core_requests]
        return dataclasses.replace(self, core_requests=reqs, grammar_future=None)


def cache_salt_of(prompt: PromptInput) -> str | None:
    # vLLM's prompt-dict field: requests with different salts never share prefix-cache blocks.
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string if provided")
    return salt


class Processor:
    def __init__(self, loaded: Any, config: ModelConfig, max_model_len: int,
                 structured_outputs: StructuredOutputsConfig | None = None,
                 scheduler: SchedulerConfig | None = None) -> None:
        self.tokenizer = loaded.tokenizer
        self.scheduling_policy = scheduler.scheduling_policy if scheduler is not None else "fcfs"
        self.vocab_size = loaded.hf_config.vocab_size
        self._eos = tuple(loaded.eos_token_ids)
        self.max_model_len = max_model_len
        default_template = loaded.chat_template
        if config.model is None and config.tokenizer is None:
            default_template = _read_template(EMBEDDED_CHAT_TEMPLATE)
        self.chat_template = _read_template(config.chat_template) or default_template
        self.grammars = GrammarCompileService(self.tokenizer, self.vocab_size, self._eos, structured_outputs)
        # Every token covers at most this many characters of text, so a text longer than
        # max_model_len * this can be refused without tokenizing it (a 30 MB prompt costs nothing).
        self.max_chars_per_token = max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        text: str | None = None
        if isinstance(prompt, ChatPrompt):
            prompt = self.render_chat(prompt)
        if isinstance(prompt, dict):
            text = prompt.get("prompt")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            text = prompt
            self.check_text_length(prompt)
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise ValueError(f"unsupported prompt type {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        self._check_num_tokens(len(ids))
        return text, ids

    def tokenize_all(self, prompts: Sequence[PromptInput]) -> list[tuple[str | None, list[int]]]:
        return [self.tokenize(p) for p in prompts]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # A text's token ids, as /tokenize reports them (its length checked first).
        self.check_text_length(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return self.tokenizer.decode(token_ids)

    def check_text_length(self, text: str, what: str = "the prompt") -> None:
        self._check_num_chars(len(text), what)

    def _check_num_chars(self, num_chars: int, what: str) -> None:
        if num_chars > self.max_model_len * self.max_chars_per_token:
            raise ValueError(f"{what} has {num_chars} characters, more than {self.max_model_len} tokens "
                             f"(max_model_len) can hold")

    def _check_num_tokens(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            raise ValueError(f"the prompt has {num_tokens} tokens, but max_model_len is {self.max_model_len}; "
                             "at least one token must be left to generate")

    def resolve_max_tokens(self, prompt_ids: list[int], params: SamplingParams) -> int:
        room = self.max_model_len - len(prompt_ids)
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                             f"{len(prompt_ids)} and max_tokens asks for {params.max_tokens} more")
        return params.max_tokens

    def check_token_ids(self, params: SamplingParams) -> None:
        # Token ids in the params index [V] logits rows; out-of-vocabulary ids would fail inside a batched
        # step, so they are refused here.
        for name, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids or () if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} must be token ids in [0, {self.vocab_size}), got {bad[:5]}")

    def eos_token_ids(self, params: SamplingParams) -> tuple[int, ...]:
        return self._eos

    def check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            # vLLM's rule: a priority would be silently ignored otherwise.
            raise ValueError(f"got priority {priority}, but priority scheduling is not enabled "
                             "(--scheduling-policy priority)")

    def process(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                arrival_time: float | None = None, priority: int = 0,
                client_request_id: str | None = None) -> ProcessedRequest:
        # client_request_id: the client request (HTTP request, generate call) this prompt is part of; the
        # scheduler is fair between client requests. None: the request alone.
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        self.check_priority(priority)
        if isinstance(prompt, ChatPrompt):
            prompt = self.render_chat(prompt)
        cache_salt = cache_salt_of(prompt)
        prompt_text, prompt_ids = self.tokenize(prompt)
        max_tokens = self.resolve_max_tokens(prompt_ids, params)
        self.check_token_ids(params)
        grammar_future = None
        if params.structured_outputs is not None:
            grammar_future = self.grammars.compile(params.structured_outputs)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        num_samples = params.best_of or params.n
        num_returned, keep_logprobs = None, True
        core_params = params
        if num_samples > params.n:
            # Ranking needs each sample's cumulative logprob, so the sampler must report logprobs.
            num_returned, keep_logprobs = params.n, params.logprobs is not None
            core_params = dataclasses.replace(params, logprobs=params.logprobs or 0)
        eos = self.eos_token_ids(params)
        reqs = []
        for i in range(num_samples):
            # Sample i of a seeded request uses seed + i, so n=4 equals four requests seeded s..s+3.
            p = core_params if num_samples == 1 else _child_params(core_params, i)
            seq_id = request_id if num_samples == 1 else f"{request_id}#{i}"
            reqs.append(EngineCoreRequest(seq_id, prompt_ids, p, max_tokens, eos, arrival,
                                          fork_of=None if i == 0 else reqs[0].req_id, cache_salt=cache_salt,
                                          priority=priority, client_request_id=client_request_id or request_id))
        return ProcessedRequest(request_id, prompt_text, prompt_ids, params, reqs, num_returned, keep_logprobs,
                                grammar_future)

    def process_all(self, requests: Sequence[tuple[str, PromptInput, SamplingParams]],
                    priority: int = 0) -> list[ProcessedRequest]:
        # The prompts of one client request, named by its first request id (the scheduler is fair between
        # client requests).
        client_id = requests[0][0] if requests else None
        return [self.process(rid, prompt, params, priority=priority, client_request_id=client_id)
                for rid, prompt, params in requests]

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"each message needs a 'role', got {m!r}")
        # All their text (contents, tool calls, tool definitions) is rendered into the prompt: too much of it
        # is refused before the template renders it and the tokenizer thread spends seconds on it.
        self._check_num_chars(_num_text_chars([messages, kwargs.get("tools")]), "the chat (messages and tools)")
        template = _read_template(chat_template) or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template=")
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # jinja2 errors, the template's raise_exception(): the request's fault
            if isinstance(exc, ValueError):
                raise
            raise ValueError(f"the chat template failed on these messages: {exc}") from exc

    def render_chat(self, chat: ChatPrompt) -> dict[str, Any]:
        prompt = self.chat_prompt(chat.messages, chat.chat_template, chat.add_generation_prompt,
                                  **(chat.template_kwargs or {}))
        return prompt if chat.cache_salt is None else {**prompt, "cache_salt": chat.cache_salt}

    def chat_prompt(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        # The template already holds any special tokens; encoding must not add a second BOS.
        text = self.apply_chat_template(messages, chat_template, add_generation_prompt, **kwargs)
        self.check_text_length(text)
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}


def _num_text_chars(value: Any) -> int:
    # Characters in all strings (keys too) of nested dicts and lists; iterative, whatever the nesting.
    num_chars, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            num_chars += len(node)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return num_chars


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else params.seed + index
    # Prompt logprobs belong to the request: the first sample computes them, the others fork its prompt
    # blocks (or, failing that, may take prefix-cache hits) and need not score the prompt again.
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, best_of=None, seed=seed, prompt_logprobs=prompt_logprobs)


def _read_template(template: str | None) -> str | None:
    # A template argument may be a file path or the template text itself.
    if template is None:
        return None
    if ("{%" not in template and "{{" not in template) and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    return template
