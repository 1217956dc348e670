"""Frozen engine configuration. Devices and dtypes come from here, never from globals.

The defaults below are the engine's defaults; `EngineArgs` (engine/arg_utils.py) reads them from these
dataclasses, so `LLM(...)`, `pagedserve generate/chat` and `pagedserve serve` share one set. Each dataclass
checks its own fields; checks across fields live in `EngineArgs.create_engine_config` and, for the limits
that need the loaded model and the sized KV pool, in `resolve_limits`.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("gguf", "int8", "awq", "gptq", "compressed-tensors", "fp8", "none")
# --load-format: "auto" reads the weights from the model path; "dummy" draws random ones of its config's shape
# (model/dummy_weights.py), so a config.json and tokenizer files are enough.
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "reference", "cpu")
# The default per-step token budget adapts between these two (core/token_budget.py): the most while few
# requests decode, down to the floor (plus one token per decode) while many do. Without chunked prefill a whole
# prompt must fit one step, so the budget is fixed and grows to max_model_len there (as vLLM). Why both ends:
# vLLM's CPU servers take 2048; a fixed 512 served better on an AMX Xeon (bf16, 2 threads, benchmarks/HISTORY.md
# "Token budget"): 16 streams over HTTP, two runs in swapped order, 512 gave 1.13x and 1.15x the output tokens/s
# of 2048 (TPOT p50 0.87-0.89x: decodes share shorter steps), but a burst of prompts prefills 1.9x faster with
# 2048 (above 512 rows the GGUF blocks go to oneDNN's AMX GEMM on dequantized tiles), which is the TTFT tail.
CHUNKED_PREFILL_BATCHED_TOKENS = 2048
MIN_BATCHED_TOKENS = 512
# A prefill takes at most this many tokens of a step while other requests need the budget (vLLM's
# --long-prefill-token-threshold), so one long prompt does not hold every short one behind it.
LONG_PREFILL_TOKEN_THRESHOLD = 512
# The offline LLM's default, fixed (vLLM too gives its LLM class a larger budget than its server): nobody waits
# on a token there, and a burst of 16 prompts prefilled 1.9x faster with 2048 than with 512 (interleaved rounds,
# benchmarks/token_budget.py); the 64-request offline workload measured 358 vs 279 and 297 vs 293 output tok/s
# in two pairs of runs (benchmarks/HISTORY.md "Token budget").
OFFLINE_BATCHED_TOKENS = 2048


def json_object(value: object, what: str) -> dict:
    """value as a dict: JSON text is parsed, a dict passes; anything else is a ValueError naming `what`."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from None
        except RecursionError:  # the parser recurses per level: thousands of nested brackets
            raise ValueError(f"{what} is nested too deeply to parse") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not supported; valid values: {', '.join(LOAD_FORMATS)}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = None          # GGUF file or HF directory; None = embedded SmolLM2
    tokenizer: str | None = None      # HF tokenizer directory; defaults to the model's own
    max_model_len: int | None = None  # defaults to the model's context length, capped to the KV pool
    # "auto": bfloat16 where the device multiplies it natively, else float32 (model/dtypes.py); the engine
    # replaces it with the resolved name.
    dtype: str = "auto"
    seed: int = 0
    chat_template: str | None = None  # path or template text overriding the model's
    # "auto": the compiled CPU paged-attention kernel on CPU when it builds, else "reference" (pure torch).
    attention_backend: str = "auto"
    # --quantization: one of QUANTIZATIONS; None = the checkpoint's own method (gguf for GGUF files, awq / gptq /
    # compressed-tensors / fp8 for such checkpoints) where the block kernels run, else none
    # (model/weight_quant.py). The engine stores the resolved name.
    quantization: str | None = None
    load_format: str = "auto"  # one of LOAD_FORMATS
    # --batch-invariant: every reduction in an order independent of the batch, so a greedy request gives the same
    # tokens alone or batched, cached, chunked or speculated (docs/batch_invariance.md); costs some speed.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization {self.quantization!r} is not supported; valid values: "
                             f"{', '.join(QUANTIZATIONS)}")
        check_load_format(self.load_format)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # explicit KV pool budget
    kv_cache_fraction: float = 0.25            # of available memory when no explicit budget
    num_gpu_blocks_override: int | None = None  # exact pool size (tests)
    enable_prefix_caching: bool = True
    swap_space_gib: float = 0.0
    preemption_mode: str = "recompute"  # "recompute" or "swap"
    # --kv-cache-dtype (kv_dtypes.py): "auto" follows the model's dtype; the engine stores the resolved name.
    cache_dtype: str = "auto"
    # Touch every page of the pool at start (worker/kv_cache.py), so resident memory does not grow later.
    prefault_kv_cache: bool = True
    # The prefix cache's disk tier (core/kv_disk.py): a directory, possibly shared by replicas, and its bound.
    kv_offload_dir: str | None = None
    kv_offload_max_bytes: int | None = None

    def __post_init__(self) -> None:
        from pagedserve.kv_dtypes import canonical

        object.__setattr__(self, "cache_dtype", canonical(self.cache_dtype))  # ValueError naming the flag
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space_gib}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.kv_offload_max_bytes is not None and self.kv_offload_max_bytes < 1:
            raise ValueError(f"kv_offload_max_bytes must be >= 1, got {self.kv_offload_max_bytes}")
        if self.kv_offload_max_bytes is not None and self.kv_offload_dir is None:
            raise ValueError("--kv-offload-max-bytes needs --kv-offload-dir")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # None until resolve_limits: CHUNKED_PREFILL_BATCHED_TOKENS, or max_model_len if larger and chunking is off.
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # The adaptive budget's floor (core/token_budget.py); None: MIN_BATCHED_TOKENS, or max_num_batched_tokens if
    # smaller (a fixed budget) and always without chunked prefill. Equal to max_num_batched_tokens: fixed.
    min_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = LONG_PREFILL_TOKEN_THRESHOLD  # 0: off
    # "fcfs" or "priority" (requests' `priority`, lower first); core/scheduling_policy.py, docs/scheduling.md.
    scheduling_policy: str = "fcfs"
    # Under "priority", a request that has waited this many steps ranks one level more urgent (no starvation).
    priority_aging_steps: int = 100

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.priority_aging_steps < 1:
            raise ValueError(f"priority_aging_steps must be >= 1, got {self.priority_aging_steps}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.min_num_batched_tokens is not None and self.min_num_batched_tokens < 1:
            raise ValueError(f"min_num_batched_tokens must be >= 1, got {self.min_num_batched_tokens}")
        if (self.min_num_batched_tokens is not None and self.max_num_batched_tokens is not None
                and self.min_num_batched_tokens > self.max_num_batched_tokens):
            raise ValueError(f"min_num_batched_tokens ({self.min_num_batched_tokens}) must not exceed "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")

    def check_fits(self, max_model_len: int) -> None:
        # Without chunking a prompt is prefilled in one step; a longer one would wait forever at the head of
        # the queue and block everything behind it.
        if (not self.enable_chunked_prefill and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < max_model_len):
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                             f"({max_model_len}) with chunked prefill off, so longer prompts could never be "
                             "scheduled; increase max_num_batched_tokens, decrease max_model_len or enable "
                             "chunked prefill")


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    def resolve(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


SPECULATIVE_METHODS = ("ngram", "draft_model")
# disable_by_batch_size's default per method: no drafts above this many running requests. Speculation stops
# paying once the batch alone keeps the matrix units busy (each request's k drafts then cost nearly k decode
# tokens of verify compute). n-gram lookup is free, so only the verify grows; a draft model also runs k
# passes of its own per step, which grow with the batch, so it stops paying at a smaller batch.
# benchmarks/speculative.py's batch-size sweep (benchmarks/HISTORY.md, "Speculative decoding: batch-size
# sweep"; AMX Xeon, k = 4, full-precision bf16 target, off/on TPOT): n-gram 2.0-2.4x at 1 stream, still
# 1.17-1.38x at 16 streams, 0.86x at 32; the embedded GGUF as its own draft 1.1-1.5x at 1 stream, 1.15-1.24x
# at 2, 0.93-0.985x at 4, 0.48-0.75x at 16. Cheaper draft kernels or a smaller draft would move its cut-off up.
SPEC_DISABLE_BY_BATCH_SIZE = {"ngram": 16, "draft_model": 2}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's --speculative-config: drafts are extra query tokens of a step, verified in one forward pass.

    disable_by_batch_size defaults per method ("auto"): 16 running requests for ngram, 2 for draft_model
    (SPEC_DISABLE_BY_BATCH_SIZE, measured); an integer or None (never off) overrides it."""
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1          # ngram: shortest suffix looked up in the sequence
    prompt_lookup_max: int = 3          # ngram: longest suffix tried first
    model: str | None = None            # draft_model: GGUF file or HF directory
    dtype: str | None = None            # draft_model: the draft's dtype (a cheaper copy); None = the target's
    # draft_model: the draft's weight format (--quantization's values). "int8" also takes a GGUF file: its
    # weights are requantized to Q8_0 blocks, an approximation a draft may be (the rejection sampler keeps the
    # output the target's). None: as the target's default (gguf blocks for a GGUF file).
    quantization: str | None = None
    # No drafts in a step whose running batch holds more requests than this (vLLM V0's
    # speculative_disable_by_batch_size); None = never off; "auto" = the method's measured default
    # (SPEC_DISABLE_BY_BATCH_SIZE), which __post_init__ puts in its place.
    disable_by_batch_size: int | str | None = "auto"
    # A request whose drafts were accepted at a rate below this over its last acceptance_window draft tokens
    # gets no more drafts (spec_decode/acceptance.py); None = never.
    disable_by_acceptance_rate: float | None = None
    acceptance_window: int = 32

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                             f"and {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model' (the draft's path)")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"speculative dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        limit = self.disable_by_batch_size
        if limit == "auto":
            object.__setattr__(self, "disable_by_batch_size", SPEC_DISABLE_BY_BATCH_SIZE[self.method])
        elif limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"disable_by_batch_size must be an integer >= 1, \"auto\" or null, got {limit!r}")
        rate = self.disable_by_acceptance_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1):
            raise ValueError(f"disable_by_acceptance_rate must be a number in (0, 1] or null, got {rate!r}")
        window = self.acceptance_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"acceptance_window must be an integer >= 1, got {window!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        # The JSON of --speculative-config, a dict from LLM(speculative_config=...), or a config.
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**value)
        except TypeError as exc:
            raise ValueError(f"bad speculative_config: {exc}") from None


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    # Ranks that each hold a slice of every layer (distributed/); 1 runs the model in the engine process.
    tensor_parallel_size: int = 1
    # How long a collective waits for a missing rank before the engine gives up (a dead or stuck rank).
    distributed_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout_s}")


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    # A grammar that compiles for longer than this is refused (a 400 on the server); compiles run off the
    # engine thread, so until then the request only waits, and nobody else does.
    compile_timeout_s: float = 10.0
    # Compiled grammars kept, keyed by their spec, least recently used out: at most cache_size of them and
    # cache_memory_bytes of their memory by xgrammar's estimate (the most recent one stays even when larger).
    # A small schema's grammar is ~0.1 MB by the estimate, ~0.28 MB resident (embedded model's 49K vocabulary):
    # 16 of them ~4.5 MB; one 20,000-value enum ~100 MB. Sized so a server serving many distinct schemas stays
    # within 50 MB of its start-up memory (benchmarks/memory_soak.py); a small schema compiles in ~0.05 s.
    cache_size: int = 16
    cache_memory_bytes: int = 64 << 20
    # Each grammar thread compiles in a process of its own, killed when a compile passes the timeout (xgrammar
    # cannot cancel one): structured_output/compile_worker.py. False: compiles run on the threads, and one past
    # the timeout runs on to its end.
    compile_process: bool = True

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ValueError(f"structured outputs compile timeout must be positive, got {self.compile_timeout_s}")
        if self.cache_size < 0 or self.cache_memory_bytes < 0:
            raise ValueError(f"structured outputs cache size and memory must be >= 0, got {self.cache_size} and "
                             f"{self.cache_memory_bytes}")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's --kv-events-config: publish what the prefix cache stores and evicts (engine/kv_event_publisher.py).

    endpoint: a ZMQ address with '*' (or '::', ipc://, inproc://) is bound, as a pod's own port for routers
    that connect to every replica; any other is connected to, as an endpoint picker's central socket.
    topic: empty means kv@<pod ip>@<served model name>, the form llm-d's subscriber parses."""
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"                # "zmq", or "null" to collect nothing
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None    # a ROUTER socket that resends buffered batches from a sequence number
    buffer_steps: int = 10_000            # batches kept for replay
    hwm: int = 100_000                    # the PUB socket's high-water mark
    max_queue_size: int = 100_000         # batches waiting for the publisher thread (the engine blocks beyond)
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config enable_kv_cache_events must be true or false, got "
                             f"{self.enable_kv_cache_events!r}")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config topic must be a string, got {self.topic!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config {name} must be an integer >= 1, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or "://" not in value):
                raise ValueError(f"kv_events_config {name} must be a ZMQ address like tcp://*:5557, got {value!r}")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: "KVEventsConfig | dict | str | None") -> "KVEventsConfig | None":
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = json_object(value, "kv_events_config")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown kv_events_config keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**value)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    kv_events: KVEventsConfig | None = None


def resolve_limits(config: EngineConfig, model_max_len: int, num_blocks: int) -> EngineConfig:
    """The config with max_model_len and max_num_batched_tokens set, once the model and the KV pool are known.

    A max_model_len the user asked for must fit both the model and the pool, or the engine refuses to start;
    the model's own context length is capped to the pool with a warning instead (as vLLM), so a request
    without max_tokens (max_model_len - prompt tokens) always fits the pool.
    """
    pool_tokens = num_blocks * config.cache.block_size
    max_len = config.model.max_model_len
    if max_len is not None and max_len > model_max_len:
        raise ValueError(f"max_model_len {max_len} exceeds the model's context length {model_max_len}")
    if max_len is not None and max_len > pool_tokens:
        raise ValueError(f"max_model_len {max_len} does not fit the KV cache, which holds {pool_tokens} tokens "
                         f"({num_blocks} blocks of {config.cache.block_size}); decrease max_model_len to at most "
                         f"{pool_tokens} or give the KV cache more memory (kv_cache_memory_bytes, "
                         "kv_cache_fraction or num_gpu_blocks_override)")
    if max_len is None:
        max_len = model_max_len
        if max_len > pool_tokens:
            logger.warning("the model's context length %d does not fit the KV cache (%d tokens); capping "
                           "max_model_len to %d. Give the KV cache more memory to serve longer contexts.",
                           max_len, pool_tokens, pool_tokens)
            max_len = pool_tokens
    sched = config.scheduler
    if sched.max_num_batched_tokens is None:
        budget = CHUNKED_PREFILL_BATCHED_TOKENS
        if not sched.enable_chunked_prefill:
            budget = max(budget, max_len)
        sched = dataclasses.replace(sched, max_num_batched_tokens=budget)
    floor = sched.min_num_batched_tokens
    if not sched.enable_chunked_prefill:
        floor = sched.max_num_batched_tokens  # a whole prompt must fit every step's budget
    elif floor is None:
        floor = min(MIN_BATCHED_TOKENS, sched.max_num_batched_tokens)
    elif floor > sched.max_num_batched_tokens:
        raise ValueError(f"min_num_batched_tokens ({floor}) must not exceed max_num_batched_tokens "
                         f"({sched.max_num_batched_tokens})")
    sched = dataclasses.replace(sched, min_num_batched_tokens=floor)
    sched.check_fits(max_len)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, max_model_len=max_len),
                               scheduler=sched)
