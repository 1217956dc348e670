"""What users and the server receive, with vLLM's names (`outputs[0].text`, `finish_reason`, ...)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the model's distribution; 1 = most likely
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob, holding the sampled token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None because nothing predicts the first token.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    # The stop string or stop token id that ended the output; None for eos, length or abort.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    metrics: Any | None = None  # a metrics.stats record; Any keeps this module free of engine imports
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
