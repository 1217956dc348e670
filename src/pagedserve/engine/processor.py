"""Turns user prompts into token ids and checks them against the model's limits before they queue."""
from __future__ import annotations

from typing import Any

from pagedserve.config import ModelConfig
from pagedserve.sampling_params import SamplingParams

# A prompt is text, a list of token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": ...}.
PromptInput = str | list[int] | dict[str, Any]


def cache_salt_of(prompt: PromptInput) -> str | None:
    # vLLM's prompt-dict field: requests with different salts never share prefix-cache blocks.
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string if provided")
    return salt


class Processor:
    def __init__(self, loaded, config: ModelConfig, max_model_len: int) -> None:
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.hf_config.vocab_size
        self._eos = tuple(loaded.eos_token_ids)
        self.max_model_len = max_model_len
        self.chat_template = _read_template(config.chat_template) or loaded.chat_template

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)):
            text = None
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise ValueError(f"unsupported prompt type {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}; "
                             "at least one token must be left to generate")
        return text, ids

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
        # step and take the other requests of that step down with them, so they are refused here.
        for name, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
            bad = [t for t in ids or () if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} must be token ids in [0, {self.vocab_size}), got {bad[:5]}")

    def eos_token_ids(self, params: SamplingParams) -> tuple[int, ...]:
        return self._eos

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        template = _read_template(chat_template) or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template=")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"each message needs a 'role', got {m!r}")
        return self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)


def _read_template(template: str | None) -> str | None:
    # A template argument may be a file path or the template text itself.
    if template is None:
        return None
    import os

    if ("{%" not in template and "{{" not in template) and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    return template
