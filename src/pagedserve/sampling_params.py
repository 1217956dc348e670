"""Per-request sampling settings, with vLLM's field names and defaults so users switch by changing an import."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

# Below this temperature a request is greedy: dividing logits by ~0 would overflow, and the limit of
# softmax(logits / t) as t -> 0 is argmax anyway.
SAMPLING_EPS = 1e-5
# Positive temperatures below this are raised to it (as vLLM does): logits / 1e-4 already make the softmax
# a one-hot in fp32, and anything smaller only invites overflow.
MIN_RANDOM_TEMPERATURE = 1e-2
# What torch.Generator.manual_seed accepts; sample i of a seeded request uses seed + i, so all must fit.
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1

_INT_FIELDS = ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
# The sampler works in fp32: a larger float becomes inf there and turns masked logits into NaN.
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")


class RequestOutputKind(enum.Enum):
    # What each RequestOutput of a request holds (vLLM's names): everything so far, only what is new since
    # the previous output (servers stream these without re-diffing), or one output when the request ends.
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    # vLLM's names. Exactly one constraint: a JSON schema (dict or its JSON text), a regex, one of a list of
    # strings, an EBNF grammar (xgrammar's dialect), or any JSON object.
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or string), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalized to list[str]
    stop_token_ids: list[int] | None = None  # normalized to list[int]
    ignore_eos: bool = False  # eos does not end the request; it can still be sampled
    max_tokens: int | None = 16  # None: up to max_model_len, resolved by the engine
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> value added to its logit before sampling
    allowed_token_ids: list[int] | None = None  # sample only among these tokens
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrained decoding (pagedserve/structured_output): each step samples only tokens the grammar allows.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids or [])
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}
            except (TypeError, ValueError, OverflowError, AttributeError) as e:
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from e
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
        self._verify()
        if 0.0 < self.temperature < MIN_RANDOM_TEMPERATURE:
            self.temperature = MIN_RANDOM_TEMPERATURE
        if self.is_greedy:
            # Truncation cannot change an argmax; clearing it keeps greedy batches on the fast path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify_types(self) -> None:
        # A wrong type would otherwise pass the range checks below and fail later inside a batched engine
        # step, taking every request of that step down with it.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not abs(value) <= _FLOAT32_MAX:
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")

    def _verify(self) -> None:
        self._verify_types()
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.logit_bias and not all(abs(v) <= _FLOAT32_MAX for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be finite")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED - ((self.best_of or self.n) - 1):
            raise ValueError(f"seed must be in [{MIN_SEED}, {MAX_SEED}] for each of the request's samples "
                             f"(sample i uses seed + i), got {self.seed}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {self.structured_outputs!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string")
        if self.temperature < SAMPLING_EPS and self.n > 1:
            # n greedy samples would be n copies of one answer; vLLM rejects this too.
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")
        if self.temperature < SAMPLING_EPS and (self.best_of or 1) > 1:
            raise ValueError(f"best_of must be 1 when using greedy sampling, got {self.best_of}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self) -> SamplingParams:
        return dataclasses.replace(
            self, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
            logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids))


def _token_ids(name: str, ids: object) -> list[int]:
    try:
        return [int(t) for t in ids]  # type: ignore[attr-defined]
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{name} must be a list of token ids, got {ids!r}") from e


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
