"""What every endpoint needs: the async engine, the served model names and the request checks."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.outputs import RequestOutput
from pagedserve.server.limits import MAX_SAMPLES_PER_REQUEST, MAX_SEQUENCES_PER_REQUEST
from pagedserve.server.errors import OpenAIError
from pagedserve.server.protocol import UsageInfo


@dataclass(frozen=True, slots=True)
class RequestLimits:
    # How much one request may ask of the engine; the engine thread serves everyone, so a request past these
    # is refused with a 400 before any of its work is queued.
    max_samples: int = MAX_SAMPLES_PER_REQUEST      # n, best_of
    max_sequences: int = MAX_SEQUENCES_PER_REQUEST  # prompts x samples
    max_tokens: int | None = None                   # prompt + generated tokens; None: max_samples x max_model_len

    def check_samples(self, n: int, best_of: int | None = None) -> None:
        for name, value in (("n", n), ("best_of", best_of)):
            if value is not None and value > self.max_samples:
                raise OpenAIError(f"{name} must be at most {self.max_samples} (--max-samples-per-request), "
                                  f"got {value}", 400, param=name)

    def check_sequences(self, num_prompts: int, num_samples: int) -> None:
        if num_prompts * num_samples > self.max_sequences:
            raise OpenAIError(f"the request asks for {num_prompts} prompts x {num_samples} samples = "
                              f"{num_prompts * num_samples} sequences, more than {self.max_sequences} "
                              "(--max-sequences-per-request)", 400, param="prompt")

    def check_tokens(self, num_prompt_tokens: list[int], max_tokens: int | None, num_samples: int,
                     max_model_len: int) -> None:
        limit = self.max_samples * max_model_len if self.max_tokens is None else self.max_tokens
        total = sum(p + num_samples * (max_model_len - p if max_tokens is None else max_tokens)
                    for p in num_prompt_tokens)
        if total > limit:
            raise OpenAIError(f"the request may take {total} tokens (prompt tokens + samples x max_tokens, "
                              f"summed over its prompts), more than {limit} (--max-tokens-per-request)", 400,
                              param="max_tokens")


@dataclass(slots=True)
class ServerContext:
    engine: AsyncLLMEngine
    served_model_names: list[str]  # the first is the name responses carry
    model_path: str | None          # --model as given; None for the embedded model
    tool_call_parser: str | None = None  # --tool-call-parser, set with --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser
    limits: RequestLimits = RequestLimits()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        # No model given means the only one served (vLLM does the same).
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, param="model",
                              code="model_not_found")

    def check_priority(self, priority: int) -> None:
        try:
            self.engine.processor.check_priority(priority)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, param="priority") from None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    # The prompt counts once per request, however many samples (n) share it.
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
