"""EngineArgs, as vLLM's: every engine option under its vLLM name, its CLI flag, and the cross-field checks.

`LLM(model, **kwargs)`, `pagedserve generate/chat` and `pagedserve serve` all build their EngineConfig here.
The default values are the config dataclasses' own (config.py), read through `_default`, so each is written once.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields
from typing import Any

from pagedserve.config import (ATTENTION_BACKENDS, CHUNKED_PREFILL_BATCHED_TOKENS, DTYPES, LOAD_FORMATS,
                               MIN_BATCHED_TOKENS, QUANTIZATIONS,
                               CacheConfig, DeviceConfig, EngineConfig, KVEventsConfig, ModelConfig, ParallelConfig,
                               SchedulerConfig, SpeculativeConfig, StructuredOutputsConfig)
from pagedserve.core.kv_disk import check_offload_config
from pagedserve.core.scheduling_policy import SCHEDULING_POLICIES
from pagedserve.kv_dtypes import KV_CACHE_DTYPES


def _default(cls: type, name: str) -> Any:
    # Slotted dataclasses hide class-level defaults, so read them from the field table.
    value = cls.__dataclass_fields__[name].default
    assert value is not MISSING, f"{cls.__name__}.{name} has no default"
    return value


@dataclass(slots=True)
class EngineArgs:
    model: str | None = _default(ModelConfig, "model")
    tokenizer: str | None = _default(ModelConfig, "tokenizer")
    max_model_len: int | None = _default(ModelConfig, "max_model_len")
    dtype: str = _default(ModelConfig, "dtype")
    seed: int = _default(ModelConfig, "seed")
    chat_template: str | None = _default(ModelConfig, "chat_template")
    attention_backend: str = _default(ModelConfig, "attention_backend")
    quantization: str | None = _default(ModelConfig, "quantization")
    load_format: str = _default(ModelConfig, "load_format")
    batch_invariant: bool = _default(ModelConfig, "batch_invariant")
    block_size: int = _default(CacheConfig, "block_size")
    kv_cache_memory_bytes: int | None = _default(CacheConfig, "kv_cache_memory_bytes")
    kv_cache_fraction: float = _default(CacheConfig, "kv_cache_fraction")
    num_gpu_blocks_override: int | None = _default(CacheConfig, "num_gpu_blocks_override")
    enable_prefix_caching: bool = _default(CacheConfig, "enable_prefix_caching")
    swap_space: float = _default(CacheConfig, "swap_space_gib")  # GiB, as vLLM's swap_space
    preemption_mode: str = _default(CacheConfig, "preemption_mode")
    kv_cache_dtype: str = _default(CacheConfig, "cache_dtype")
    prefault_kv_cache: bool = _default(CacheConfig, "prefault_kv_cache")
    kv_offload_dir: str | None = _default(CacheConfig, "kv_offload_dir")
    kv_offload_max_bytes: int | None = _default(CacheConfig, "kv_offload_max_bytes")
    max_num_seqs: int = _default(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int | None = _default(SchedulerConfig, "max_num_batched_tokens")
    enable_chunked_prefill: bool = _default(SchedulerConfig, "enable_chunked_prefill")
    min_num_batched_tokens: int | None = _default(SchedulerConfig, "min_num_batched_tokens")
    long_prefill_token_threshold: int = _default(SchedulerConfig, "long_prefill_token_threshold")
    scheduling_policy: str = _default(SchedulerConfig, "scheduling_policy")
    priority_aging_steps: int = _default(SchedulerConfig, "priority_aging_steps")
    device: str = _default(DeviceConfig, "device")
    num_threads: int | None = _default(DeviceConfig, "num_threads")
    # JSON text, a dict or a SpeculativeConfig (vLLM's --speculative-config); None = no speculation.
    speculative_config: SpeculativeConfig | dict | str | None = None
    tensor_parallel_size: int = _default(ParallelConfig, "tensor_parallel_size")
    distributed_timeout: float = _default(ParallelConfig, "distributed_timeout_s")  # seconds
    structured_outputs_compile_timeout: float = _default(StructuredOutputsConfig, "compile_timeout_s")
    structured_outputs_compile_process: bool = _default(StructuredOutputsConfig, "compile_process")
    # JSON text, a dict or a KVEventsConfig (vLLM's --kv-events-config); None = no KV events.
    kv_events_config: KVEventsConfig | dict | str | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=d.model,
                       help="GGUF file or Hugging Face directory (default: the embedded SmolLM2)")
        g.add_argument("--tokenizer", default=d.tokenizer, metavar="DIR",
                       help="Hugging Face tokenizer directory (default: the model's own)")
        g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                       help="context length, prompt + output (default: the model's, capped to the KV cache)")
        g.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                       help="auto: bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, else float32")
        g.add_argument("--seed", type=int, default=d.seed, help="engine seed for unseeded sampling")
        g.add_argument("--chat-template", default=d.chat_template, metavar="FILE",
                       help="Jinja chat template (file or text) overriding the model's")
        g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=d.attention_backend,
                       help="auto: the compiled CPU kernel on CPU when it builds, else the pure-torch reference")
        g.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=d.quantization,
                       help="gguf: GGUF weights stay blocks (default for GGUF files); awq, gptq, "
                            "compressed-tensors, fp8: such checkpoints' weights as blocks (their default); int8: "
                            "weight-only int8 for float checkpoints; none: dequantized weights")
        g.add_argument("--load-format", choices=LOAD_FORMATS, default=d.load_format,
                       help="auto: the weights in --model; dummy: random weights of its config's shape (only "
                            "config.json and the tokenizer are read), to benchmark a model without its weights")
        g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=d.batch_invariant,
                       help="greedy outputs independent of the batch, the prefix cache, chunking and speculation "
                            "(docs/batch_invariance.md)")
        g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
        mem = g.add_mutually_exclusive_group()
        mem.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory_bytes", type=int,
                         default=d.kv_cache_memory_bytes, metavar="BYTES", help="explicit KV cache budget")
        mem.add_argument("--kv-cache-fraction", type=float, default=d.kv_cache_fraction, metavar="F",
                         help="KV cache budget as a fraction of free memory, when no explicit budget")
        g.add_argument("--num-gpu-blocks-override", type=int, default=d.num_gpu_blocks_override,
                       help="exact number of KV blocks, ignoring the memory budget")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching)
        g.add_argument("--swap-space", type=float, default=d.swap_space, metavar="GiB",
                       help="host memory for swapped-out KV blocks (preemption mode 'swap')")
        g.add_argument("--preemption-mode", choices=["recompute", "swap"], default=d.preemption_mode)
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                       help="KV cache element type; auto: the model's dtype. fp8_e4m3 and int8 store 1 byte per "
                            "element plus a scale per token and head (bytes per token in the start-up log)")
        g.add_argument("--prefault-kv-cache", action=argparse.BooleanOptionalAction, default=d.prefault_kv_cache,
                       help="make the whole KV pool resident at start, so resident memory does not grow toward "
                            "it later (default on; --no-prefault-kv-cache: pages become resident as first used)")
        g.add_argument("--kv-offload-dir", default=d.kv_offload_dir, metavar="DIR",
                       help="disk tier of the prefix cache: full blocks are written here by a hash of the model, "
                            "KV dtype, block size and tokens, and read back on a prefix-cache miss (survives "
                            "restarts; replicas may share the directory)")
        g.add_argument("--kv-offload-max-bytes", type=int, default=d.kv_offload_max_bytes, metavar="BYTES",
                       help="bound on the disk tier's files; the least recently used go first (default: none)")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="requests per step")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help=f"most tokens per step (default: {CHUNKED_PREFILL_BATCHED_TOKENS}, or max_model_len "
                            "if larger and chunked prefill is off); the budget adapts down to "
                            "--min-num-batched-tokens while many requests decode (docs/scheduling.md)")
        g.add_argument("--min-num-batched-tokens", type=int, default=d.min_num_batched_tokens,
                       help=f"the adaptive budget's floor, plus one token per decoding request (default: "
                            f"{MIN_BATCHED_TOKENS} or --max-num-batched-tokens if smaller; equal to it: a fixed "
                            "budget; without chunked prefill always fixed)")
        g.add_argument("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold,
                       help="a prompt takes at most this many tokens of a step while others need the budget, so "
                            "one long prompt does not hold every short one (0: off)")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=d.enable_chunked_prefill)
        g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=d.scheduling_policy,
                       help="fcfs: first come, first served (fair between client requests); priority: requests' "
                            "`priority` (lower first) orders the queue and preempts less urgent running requests "
                            "(docs/scheduling.md)")
        g.add_argument("--priority-aging-steps", type=int, default=d.priority_aging_steps, metavar="STEPS",
                       help="with --scheduling-policy priority: a request waiting this many steps ranks one "
                            "priority level more urgent, so none starves")
        g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
        g.add_argument("--num-threads", type=int, default=d.num_threads,
                       help="torch CPU threads (per rank with tensor parallelism; default: the cores / ranks)")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size, metavar="N",
                       help="split every layer across N ranks, one process each (gloo on CPU, NCCL on CUDA)")
        g.add_argument("--distributed-timeout", type=float, default=d.distributed_timeout, metavar="SECONDS",
                       help="how long a rank waits for the others in a collective before the engine fails")
        g.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 3, '
                            '"prompt_lookup_max": 3}')
        g.add_argument("--structured-outputs-compile-timeout", type=float,
                       default=d.structured_outputs_compile_timeout, metavar="S",
                       help="seconds a grammar (JSON schema, regex, ...) may compile before the request is refused")
        g.add_argument("--structured-outputs-compile-process", action=argparse.BooleanOptionalAction,
                       default=d.structured_outputs_compile_process,
                       help="compile grammars in processes of their own, killed when a compile passes the timeout "
                            "(default on; off: compiles run on threads, and one past the timeout runs on)")
        g.add_argument("--kv-events-config", default=None, metavar="JSON",
                       help='publish prefix-cache stores and evictions over ZMQ in vLLM\'s format, e.g. '
                            '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"} (docs/kv_events.md)')
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def create_engine_config(self) -> EngineConfig:
        # Each config checks its own fields; what spans fields and is known before the model loads is checked
        # here, and config.resolve_limits finishes once the model's context and the KV pool are known.
        scheduler = SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill,
                                    min_num_batched_tokens=self.min_num_batched_tokens,
                                    long_prefill_token_threshold=self.long_prefill_token_threshold,
                                    scheduling_policy=self.scheduling_policy,
                                    priority_aging_steps=self.priority_aging_steps)
        if self.max_model_len is not None:
            scheduler.check_fits(self.max_model_len)
        config = EngineConfig(
            model=ModelConfig(self.model, self.tokenizer, self.max_model_len, self.dtype, self.seed,
                              self.chat_template, self.attention_backend, self.quantization, self.load_format,
                              self.batch_invariant),
            cache=CacheConfig(self.block_size, self.kv_cache_memory_bytes, self.kv_cache_fraction,
                              self.num_gpu_blocks_override, self.enable_prefix_caching, self.swap_space,
                              self.preemption_mode, self.kv_cache_dtype, self.prefault_kv_cache,
                              self.kv_offload_dir, self.kv_offload_max_bytes),
            scheduler=scheduler,
            device=DeviceConfig(self.device, self.num_threads),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            parallel=ParallelConfig(self.tensor_parallel_size, self.distributed_timeout),
            structured_outputs=StructuredOutputsConfig(
                self.structured_outputs_compile_timeout, compile_process=self.structured_outputs_compile_process),
            kv_events=KVEventsConfig.parse(self.kv_events_config))
        check_offload_config(config)
        return config
